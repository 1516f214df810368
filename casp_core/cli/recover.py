"""`casp recover CHECKPOINT --dataset SPEC --out DIR`: recovery of a saved checkpoint into a new one (LoRA, or every
decoder weight with `--method full`), with the recovery settings of a job (casp_core.settings.RecoveryConfig) as flags
of their own names (`--max-steps`, `--rank`)."""

import argparse
import json
from pathlib import Path

from casp_core.cli.progress import local_run
from casp_core.cli.setting_flags import add_machine_flags, add_setting_flags, bare_flag, settings_from_args
from casp_core.errors import InvalidConfig
from casp_core.settings import LORA_ONLY_SETTINGS, RecoveryConfig

# Distillation needs the dense model, which a saved checkpoint does not bring: a job's settings only.
DISTILLATION = ("loss", "temperature", "ce_weight", "teacher_top_k")
METHODS = ("lora", "full")

DESCRIPTION = (
    "Fine-tune a checkpoint written by `casp prune` into a new checkpoint: LoRA adapters merged into the weights "
    "(--method lora), or every weight of the decoder layers (--method full). Distillation (casp prune's "
    "--recovery-loss distill) is not offered here: it trains towards the dense model's next-token distribution, and "
    "a checkpoint does not carry the dense model; prune with --recovery and --recovery-loss instead."
)


def add_recover_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "recover",
        help="fine-tune a pruned checkpoint (LoRA or every decoder weight) into a new checkpoint",
        description=DESCRIPTION,
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory written by `casp prune`")
    parser.add_argument("--out", required=True, type=Path, help="output directory (must be new or empty)")
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="lora",
        help="lora: train LoRA adapters and merge them into the weights; full: train every weight of the decoder "
        "layers (AdamW, gradient checkpointing; the LoRA flags do not apply)",
    )
    add_setting_flags(
        parser,
        model=RecoveryConfig,
        flag=bare_flag,
        skip=("method", "save_every", *DISTILLATION),
        required=("dataset",),
    )
    add_machine_flags(parser)
    parser.set_defaults(run=run_recover)


def run_recover(args: argparse.Namespace) -> int:
    from casp_core.job.run import recover_checkpoint  # torch and transformers load only when needed
    from casp_core.model import resolve_device

    settings = settings_from_args(args, RecoveryConfig)
    unused = [name for name in LORA_ONLY_SETTINGS if name in settings]
    if args.method != "lora" and unused:
        raise InvalidConfig(f"{bare_flag(unused[0])}: a LoRA setting, unused by --method {args.method}")
    config = RecoveryConfig.from_dict({**settings, "method": args.method})
    resolve_device(args.device)
    with local_run() as run:
        summary = recover_checkpoint(
            args.checkpoint, config, args.out, run, datasets_dir=args.datasets_dir, device=args.device
        )
    final = summary["curve"][-1]["loss"] if summary["curve"] else None
    print(json.dumps({"out": str(args.out), "steps": summary["steps"], "final_loss": final}))
    return 0
