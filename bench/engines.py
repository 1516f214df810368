"""Serving speed bench: prefill and decode tokens/s of dense and pruned models in llama.cpp and transformers.

A random-initialised LLaMA (speed depends on the shapes, not on the weights' values) with the vocabulary of a
fixture tokenizer, so that real calibration text goes through the pipeline; pruned by casp_core at each ratio
under each `round_to` rounding, exported to GGUF, then timed in llama.cpp (llama-cpp-python) and in transformers
(float32 on the CPU). The machine is shared, so the variants are interleaved within each repeat (in a rotating
order) and medians are taken. The goal for each pruned variant: a speedup of at least 0.9 x (dense decoder
parameters / pruned decoder parameters). Writes bench/results/engines.json and engines.md.
"""

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import torch
from transformers import LlamaForCausalLM, PreTrainedModel

from bench.common import (
    RESULTS_DIR,
    all_finite,
    concurrency_note,
    default_datasets_dir,
    default_models_dir,
    finish_machine_info,
    machine_info,
    machine_line,
    write_json,
)
from bench.shapes import llama_config
from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.artifacts.gguf.writer import export_gguf
from casp_core.method.allocation import layer_sensitivities
from casp_core.method.calibration import CalibrationPlan, calibration_windows
from casp_core.method.prune import prune
from casp_core.model import decoder_layers, load_tokenizer, prunable_parameters
from casp_core.rounding import round_to_for
from casp_core.run import Run
from casp_core.settings import CalibrationConfig, PruneConfig

CPU = torch.device("cpu")
HEAD_DIM = 128
GOAL_FRACTION = 0.9  # of the parameter ratio: the speedup the issue asks each engine for
ENGINES = ("llama.cpp", "transformers")
PHASES = ("prefill", "decode")
DECODE_CONTEXT = 16  # prompt tokens before the timed decode steps
QUICK = [
    "--hidden", "64", "--layers", "2", "--ffn", "256", "--heads", "4", "--kv-heads", "2", "--ratios", "0.5",
    "--roundings", "1", "auto", "--prompt-tokens", "32", "--decode-tokens", "8", "--repeats", "1",
    "--n-samples", "2", "--seq-len", "32",
]  # fmt: skip


@dataclass
class Variant:
    """One model the engines time: the dense one, or one pruned at `ratio` under `round_to`."""

    name: str
    ratio: float | None
    round_to: int | str | None
    checkpoint: Path
    gguf: Path
    decoder_parameters: int
    ffn_widths: list[int]
    heads: list[int]
    kv_heads: list[int]
    kv_repeated_layers: list[int]
    prune_seconds: float | None = None
    achieved_ratio: float | None = None
    reused: bool = False  # pruned by an earlier run into --work


def random_dense(args: argparse.Namespace, vocab: int) -> LlamaForCausalLM:
    config = llama_config(
        hidden=args.hidden, layers=args.layers, ffn=args.ffn, heads=args.heads, kv_heads=args.kv_heads, vocab=vocab,
        head_dim=args.hidden // args.heads,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def shapes_of(model: PreTrainedModel) -> dict[str, list[int]]:
    layers = decoder_layers(model)
    head_dim = model.config.head_dim
    return {
        "ffn_widths": [layer.mlp.down_proj.in_features for layer in layers],
        "heads": [layer.self_attn.q_proj.out_features // head_dim for layer in layers],
        "kv_heads": [layer.self_attn.k_proj.out_features // head_dim for layer in layers],
    }


VARIANT_FILE = "variant.json"


def save_variant(variant: Variant) -> Variant:
    description = {**asdict(variant), "checkpoint": variant.checkpoint.name, "gguf": variant.gguf.name}
    (variant.checkpoint / VARIANT_FILE).write_text(json.dumps(description, indent=1) + "\n")
    return variant


def saved_variant(directory: Path) -> Variant | None:
    """A variant an earlier run of the same settings pruned into `--work` (None when there is none)."""
    if not (directory / VARIANT_FILE).is_file():
        return None
    description = json.loads((directory / VARIANT_FILE).read_text())
    return Variant(**{**description, "checkpoint": directory, "gguf": directory / description["gguf"], "reused": True})


def prune_variants(args: argparse.Namespace, work: Path) -> list[Variant]:
    """The dense checkpoint and one pruned checkpoint per ratio and rounding, each with its GGUF file; those an
    earlier run left in `work` are reused (pruning is most of the run on a busy 2-core machine)."""
    tokenizer = load_tokenizer(str(Path(args.models_dir) / args.tokenizer_model))
    dense_dir = work / "dense"
    dense_variant = saved_variant(dense_dir)
    if dense_variant is None:
        dense = random_dense(args, len(tokenizer))
        dense.save_pretrained(dense_dir, safe_serialization=True)
        tokenizer.save_pretrained(dense_dir)
        exported = export_gguf(dense_dir, dense_dir / "model-f16.gguf", "f16")
        dense_variant = save_variant(
            Variant("dense", None, None, dense_dir, exported.path, prunable_parameters(dense), **shapes_of(dense),
                    kv_repeated_layers=[])
        )  # fmt: skip
    variants = [dense_variant]
    calibration = CalibrationConfig(
        dataset=args.calibration_dataset, n_samples=args.n_samples, seq_len=args.seq_len, batch_size=args.n_samples
    )
    base = PruneConfig(
        ratio=0.5, solver=args.solver, compensation=args.compensation, calibration=calibration,
        datasets_dir=args.datasets_dir, device="cpu",
    )  # fmt: skip
    windows: torch.Tensor | None = None
    sensitivities: list[float | None] = []
    for ratio in args.ratios:
        for rounding in args.roundings:
            name = f"{ratio} round_to {rounding}"
            directory = work / name.replace(" ", "_")
            reused = saved_variant(directory)
            if reused is not None:
                variants.append(reused)
                continue
            model = LlamaForCausalLM.from_pretrained(dense_dir).eval()
            if windows is None:  # the same dense model and windows for every run
                windows = calibration_windows(tokenizer, CalibrationPlan.of(base, model.config))
                sensitivities = layer_sensitivities(
                    model, windows, batch_size=base.calibration.batch_size, device=CPU, run=Run()
                )
            config = base.model_copy(update={"ratio": ratio, "round_to": rounding})
            start = time.perf_counter()
            result = prune(model, tokenizer, config, windows=windows, sensitivities=sensitivities)
            seconds = time.perf_counter() - start
            save_pruned(result.model, tokenizer, directory)
            exported = export_gguf(directory, directory / "model-f16.gguf", "f16")
            variants.append(
                save_variant(
                    Variant(name, ratio, rounding, directory, exported.path, result.params_pruned,
                            **shapes_of(result.model), kv_repeated_layers=list(exported.kv_repeated_layers),
                            prune_seconds=seconds, achieved_ratio=1 - result.params_pruned / result.params_dense)
                )
            )  # fmt: skip
            print(f"{name}: pruned in {seconds:.1f}s, FFN widths {sorted(set(variants[-1].ffn_widths))}")
    return variants


# ---------------------------------------------------------------- timing


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class LlamaCppTimer:
    """llama.cpp through llama-cpp-python: the whole prompt in one batch, then one token per decode step."""

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
            n_threads_batch=threads, verbose=False,
        )  # fmt: skip

    def prefill(self, tokens: list[int]) -> float:
        self.llm.reset()
        return timed(lambda: self.llm.eval(tokens))

    def decode(self, context: list[int], tokens: list[int]) -> float:
        self.llm.reset()
        self.llm.eval(context)

        def steps() -> None:
            for token in tokens:
                self.llm.eval([token])

        return timed(steps)


class TransformersTimer:
    """transformers in float32 on the CPU: one forward pass over the prompt, then cached single-token steps."""

    def __init__(self, checkpoint: Path, dense: bool) -> None:
        model = LlamaForCausalLM.from_pretrained(checkpoint) if dense else load_pruned(checkpoint, dtype="float32")[0]
        self.model = model.eval()

    @torch.inference_mode()
    def prefill(self, tokens: list[int]) -> float:
        ids = torch.tensor([tokens])
        return timed(lambda: self.model(ids, use_cache=False))

    @torch.inference_mode()
    def decode(self, context: list[int], tokens: list[int]) -> float:
        cache = self.model(torch.tensor([context]), use_cache=True).past_key_values

        def steps() -> None:
            for token in tokens:
                self.model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)

        return timed(steps)


def measure(args: argparse.Namespace, variants: list[Variant]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Seconds per repeat: engine -> variant -> phase -> [seconds]. Every repeat times every variant, in an order
    rotated by one each repeat, so that a burst of other work on the machine does not fall on one variant."""
    generator = torch.Generator().manual_seed(1)
    vocab = 0
    prompt: list[int] = []
    seconds: dict[str, dict[str, dict[str, list[float]]]] = {}
    for engine in args.engines:
        timers: dict[str, LlamaCppTimer | TransformersTimer] = {}
        for variant in variants:
            if engine == "llama.cpp":
                timers[variant.name] = LlamaCppTimer(variant.gguf, args.threads, args.prompt_tokens + DECODE_CONTEXT)
            else:
                timers[variant.name] = TransformersTimer(variant.checkpoint, variant.ratio is None)
            vocab = vocab or len(load_tokenizer(str(variant.checkpoint)))
        prompt = torch.randint(vocab, (args.prompt_tokens,), generator=generator).tolist()
        new_tokens = torch.randint(vocab, (args.decode_tokens,), generator=generator).tolist()
        runs = {variant.name: {phase: [] for phase in PHASES} for variant in variants}
        for timer in timers.values():  # untimed: the first call pays for allocation and page faults
            timer.prefill(prompt)
            timer.decode(prompt[:DECODE_CONTEXT], new_tokens[:2])
        for repeat in range(args.repeats):
            shift = repeat % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                timer = timers[variant.name]
                runs[variant.name]["prefill"].append(timer.prefill(prompt))
                runs[variant.name]["decode"].append(timer.decode(prompt[:DECODE_CONTEXT], new_tokens))
            print(f"{engine} repeat {repeat + 1}/{args.repeats} done")
        seconds[engine] = runs
        del timers
    return seconds


def summarise(
    args: argparse.Namespace, variants: list[Variant], seconds: dict[str, dict[str, dict[str, list[float]]]]
) -> list[dict[str, Any]]:
    """One row per engine and variant: median tokens/s, the speedup over dense, the goal and whether it is met."""
    dense = variants[0]
    tokens = {"prefill": args.prompt_tokens, "decode": args.decode_tokens}
    rows = []
    for engine, runs in seconds.items():
        dense_rate = {phase: tokens[phase] / statistics.median(runs[dense.name][phase]) for phase in PHASES}
        for variant in variants:
            parameter_ratio = dense.decoder_parameters / variant.decoder_parameters
            goal = GOAL_FRACTION * parameter_ratio if variant.ratio is not None else None
            row: dict[str, Any] = {
                "engine": engine,
                "variant": variant.name,
                "ratio": variant.ratio,
                "round_to": variant.round_to,
                "decoder_parameters": variant.decoder_parameters,
                "parameter_ratio": parameter_ratio,
                "goal_speedup": goal,
            }
            for phase in PHASES:
                rate = tokens[phase] / statistics.median(runs[variant.name][phase])
                speedup = rate / dense_rate[phase]
                row[phase] = {
                    "tokens_per_second": rate,
                    "seconds": runs[variant.name][phase],
                    "speedup": speedup,
                    "meets_goal": None if goal is None else speedup >= goal,
                }
            rows.append(row)
    return rows


# ---------------------------------------------------------------- output


def _cell(phase: dict[str, Any], goal: float | None) -> str:
    if goal is None:
        return f"{phase['tokens_per_second']:.1f}"
    verdict = "pass" if phase["meets_goal"] else "fail"
    return f"{phase['tokens_per_second']:.1f} ({phase['speedup']:.2f}x, {verdict})"


def _reuse_note(payload: dict[str, Any]) -> list[str]:
    reused = payload["settings"].get("reused_checkpoints")
    if not reused:
        return []
    seconds = sum(v["prune_seconds"] or 0.0 for v in payload["variants"] if v["name"] in reused)
    return [
        "",
        f"The checkpoints were pruned by an earlier run into `--work` ({seconds:.0f} s of pruning for "
        f"{len(reused) - 1} pruned variants, `variants[].prune_seconds`) and timed again by this one "
        f"(`{' '.join(payload['settings'].get('command', []))}`).",
    ]


def render_markdown(payload: dict[str, Any]) -> str:
    settings, machine = payload["settings"], payload["machine"]
    lines = [
        "# Serving speed: dense against pruned in llama.cpp and transformers",
        "",
        f"Generated by `bench/engines.py` ({settings['total_seconds']:.0f} s). Machine: {machine_line(machine)}; "
        f"llama-cpp-python {settings['llama_cpp_python']}, {settings['threads']} threads in both engines.",
        concurrency_note(machine),
        "",
        f"Model: a random-initialised LLaMA, hidden {settings['hidden']}, {settings['layers']} layers, FFN "
        f"{settings['ffn']}, {settings['heads']} heads over {settings['kv_heads']} key/value heads, the "
        f"{settings['tokenizer_model']} tokenizer's vocabulary ({settings['vocab']}); pruned by casp_core "
        f"(gradient allocation, solver {settings['solver']}, compensation {settings['compensation']}: the kept "
        f"counts, which speed depends on, come from the allocation and the budget alone; calibration "
        f"{settings['n_samples']} x {settings['seq_len']} tokens of {settings['calibration_dataset']}), "
        "exported to GGUF f16; transformers runs float32. Prefill: one "
        f"{settings['prompt_tokens']}-token prompt; decode: {settings['decode_tokens']} tokens one at a time after "
        f"{DECODE_CONTEXT} prompt tokens. Median of {settings['repeats']} repeats, variants interleaved.",
        *_reuse_note(payload),
        "",
        f"Goal: speedup >= {GOAL_FRACTION} x (dense decoder parameters / pruned decoder parameters). Cells: tokens/s "
        "(speedup over dense, goal met).",
        "",
        "| engine | variant | FFN widths kept | decoder params | goal | prefill tok/s | decode tok/s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    widths = {variant["name"]: variant["ffn_widths"] for variant in payload["variants"]}
    for row in payload["rows"]:
        kept = sorted(set(widths[row["variant"]]))
        shown = ", ".join(map(str, kept[:4])) + (", ..." if len(kept) > 4 else "")
        goal = f"{row['goal_speedup']:.2f}x" if row["goal_speedup"] is not None else ""
        lines.append(
            f"| {row['engine']} | {row['variant']} | {shown} | {row['decoder_parameters'] / 1e6:.1f} M | {goal} | "
            f"{_cell(row['prefill'], row['goal_speedup'])} | {_cell(row['decode'], row['goal_speedup'])} |"
        )
    lines += ["", payload["gpu"]["reason"], ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and one repeat: seconds, for tests")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.3, 0.5])
    parser.add_argument(
        "--roundings", nargs="+", default=["1", "auto"], help="round_to values: 1 was the default, auto is"
    )
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tokenizer-model", default="ptbwiki-7M", help="fixture whose tokenizer the model uses")
    parser.add_argument("--calibration-dataset", default="wikitext2:validation")
    # Speed depends on how many units each layer keeps (the allocation and the budget), not on which: the
    # fastest solver and no compensation keep a 16-layer model's pruning to a minute or two on a busy 2-core box.
    parser.add_argument("--solver", default="diagonal")
    parser.add_argument("--compensation", default="none")
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--datasets-dir", default=default_datasets_dir())
    parser.add_argument("--models-dir", default=default_models_dir())
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--work",
        type=Path,
        help="keep the checkpoints here (default: a temporary folder); those already there, "
        "from an earlier run with the same model settings, are timed again, not pruned again",
    )
    argv = list(argv if argv is not None else sys.argv[1:])
    if "--quick" in argv:
        argv = QUICK + argv  # later flags win
    args = parser.parse_args(argv)
    args.roundings = [rounding if rounding == "auto" else int(rounding) for rounding in args.roundings]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info()
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="casp-engines-")))
        variants = prune_variants(args, work)
        seconds = measure(args, variants)
    rows = summarise(args, variants, seconds)
    payload = {
        "rows": rows,
        "variants": [
            {
                "name": v.name,
                "ratio": v.ratio,
                "round_to": v.round_to,
                "round_to_used": sorted({round_to_for(args.ffn, v.round_to)}) if v.round_to is not None else None,
                "decoder_parameters": v.decoder_parameters,
                "achieved_ratio": v.achieved_ratio,
                "ffn_widths": v.ffn_widths,
                "heads": v.heads,
                "kv_heads": v.kv_heads,
                "kv_repeated_layers": v.kv_repeated_layers,
                "prune_seconds": v.prune_seconds,
            }
            for v in variants
        ],
        "gpu": {"measured": False, "reason": "No GPU was lent to this task: transformers ran on the CPU only."},
        "machine": finish_machine_info(machine),
        "settings": {
            **{key: value for key, value in vars(args).items() if key not in ("out", "quick", "work")},
            "reused_checkpoints": [variant.name for variant in variants if variant.reused],
            "vocab": len(load_tokenizer(str(Path(args.models_dir) / args.tokenizer_model))),
            "head_dim": args.hidden // args.heads,
            "llama_cpp_python": llama_cpp.__version__,
            "gguf_type": "f16",
            "transformers_dtype": "float32",
            "decode_context": DECODE_CONTEXT,
            "total_seconds": time.perf_counter() - start,
            "command": ["python", "-m", "bench.engines", *(argv if argv is not None else sys.argv[1:])],
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "engines.json", payload)
    (args.out / "engines.md").write_text(render_markdown(payload))
    if not all_finite(payload):
        raise SystemExit("engines bench produced a non-finite number; see engines.json")
    return payload


if __name__ == "__main__":
    main()
