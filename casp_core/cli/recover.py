"""`casp recover CHECKPOINT --dataset SPEC --out DIR`: LoRA recovery of a saved checkpoint into a new one, with the
recovery settings of a job (casp_core.config.RecoveryConfig) as flags of their own names (`--max-steps`, `--rank`)."""

import argparse
import json
from pathlib import Path

from casp_core.cli.progress import StageBars
from casp_core.cli.setting_flags import add_machine_flags, add_setting_flags, bare_flag, settings_from_args
from casp_core.config import RecoveryConfig

# Distillation needs the dense model, which a saved checkpoint does not bring: a job's settings only.
DISTILLATION = ("loss", "temperature", "ce_weight", "teacher_top_k")


def add_recover_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("recover", help="fine-tune a pruned checkpoint with LoRA into a new checkpoint")
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory written by `casp prune`")
    parser.add_argument("--out", required=True, type=Path, help="output directory (must be new or empty)")
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
    from casp_core.job import recover_checkpoint  # torch and transformers load only when needed
    from casp_core.model import resolve_device
    from casp_core.run import Run

    config = RecoveryConfig.from_dict({**settings_from_args(args, RecoveryConfig), "method": "lora"})
    resolve_device(args.device)
    bars = StageBars()
    try:
        summary = recover_checkpoint(
            args.checkpoint, config, args.out, Run(progress=bars), datasets_dir=args.datasets_dir, device=args.device
        )
    finally:
        bars.close()
    final = summary["curve"][-1]["loss"] if summary["curve"] else None
    print(json.dumps({"out": str(args.out), "steps": summary["steps"], "final_loss": final}))
    return 0
