"""Memory bench: the peak host RSS of whole pruning jobs against the size of the model's weights.

Random shapes (#15): a random LLaMA-shaped model of about 1B parameters in bfloat16, written once with
`save_pretrained` (safetensors) beside the ptbwiki-7M tokenizer; the job (`run_job`, CPU, a short calibration, no
evaluation) in a fresh Python process, which reports its peak RSS (VmHWM) and the peak reached during each stage.
Bound: peak RSS <= `RSS_FACTOR` x the checkpoint's size plus the fixed `RSS_MARGIN_MIB`, asserted by
tests/core/method/test_host_memory.py on `job_settings` (no compensation, which keeps it short) and measured here on
those and on the default least-squares compensation.

The real model (#37): SmolLM2-135M-Instruct from its GGUF file (dequantized to float32, as `casp prune --model
file.gguf` loads it on the CPU), `casp prune --ratio 0.2` with every other setting at its default (gradient
allocation, least squares, WikiText-2 and PTB perplexity of the dense and the pruned model at 8 windows of 2048
tokens) and the WikiText-2 validation file as calibration text, at 32 x 512 and at the default 128 x 2048
calibration tokens. Bound: `JOB_FACTOR` x the model's bytes at its dtype + `JOB_MARGIN_BYTES`, every stage; the
slow test holds it at 32 x 512. Each job gets a cache folder of its own, so nothing is reused from an earlier run
(the dequantized file, the dense evaluation).

Recovery on the real model (`--parts recovery`): the same job at ratio 0.3 with the 32 x 512 calibration and one
perplexity window a text, then LoRA recovery at its default batch (8 x 256 tokens) for `RECOVERY_STEPS` steps on
the head of PTB train, once with each loss (`RECOVERY_LOSSES`): the recovery stage's peak beside
casp_core.method.placement's estimate, and beside the float32 logits of the whole batch (8 x 256 x 49,152), which
recovery held before its loss took them a chunk at a time. A row is keyed by its loss and commit, so the same
command from an older checkout adds that commit's rows.

Writes bench/results/memory.json and memory.md; a run of some parts (`--parts`) keeps the others' last figures.
"""

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from bench.common import (
    RESULTS_DIR,
    SMOLLM2_GGUF,
    default_datasets_dir,
    default_models_dir,
    finish_machine_info,
    git_commit,
    machine_info,
    machine_line,
    run_child,
    write_json,
)
from bench.shapes import llama_config
from casp_core.artifacts.gguf.source import gguf_config
from casp_core.method.placement import (
    CROSS_ENTROPY_LOGITS,
    DISTILLATION_LOGITS,
    ModelShape,
    estimate_recovery_memory,
)
from casp_core.run import Run
from casp_core.settings import CROSS_ENTROPY_LOSS, RecoveryConfig

# The bound. 1.3 x: the weights once, resident from the memory-mapped file, and 30 % over them. The margin and
# those 30 % (540 MiB at 1B) hold what does not scale with the weights: Python, torch and transformers with
# the tokenizer (about 520 MiB before any weight is read) and one layer's working memory, a few
# FFN-width-squared matrices (at FFN 5632: C in float32 and Q, 127 MiB each, with |Q| while rho is taken; for the
# least-squares refit C_kk and its Cholesky factor in float64, 2 x 124 MiB). Measured at 1B
# (bench/results/memory.md): 1.3 x + 412 MiB without compensation (the test's settings), + 491 MiB with the
# refit; 700 leaves room for another allocator or library version. Masked and pruned model side by side (+840 MiB)
# or a second copy of the pruned one (+640 MiB) exceed it.
RSS_FACTOR = 1.3
RSS_MARGIN_MIB = 700
RUNTIME_MIB = 520  # the process before any weight is read


# What the bench measures: the test's settings, and the default compensation, whose refit holds the most.
COMPENSATIONS = ("none", "least_squares")


def rss_bound_mib(weights_mib: float) -> float:
    return RSS_FACTOR * weights_mib + RSS_MARGIN_MIB


# The whole job's bound (#37), evaluation and gradient allocation included: the model twice (the dense weights and
# the pruned model built beside them, at most) and 1.5 GB for the runtime (about 520 MiB), the calibration
# activations and one batch's working memory.
JOB_FACTOR = 2.0
JOB_MARGIN_BYTES = 1.5e9


def job_bound_mib(model_mib: float) -> float:
    return JOB_FACTOR * model_mib + JOB_MARGIN_BYTES / 2**20


# n_samples x seq_len: the short calibration and the default.
REAL_MODEL_CALIBRATIONS = ((32, 512), (128, 2048))


# Recovery: what it trains on (PTB train's head: a few dozen 256-token sequences, so the distillation's teacher pass
# takes seconds), its steps, and the losses measured (distillation holds the most: the tempered log-softmax and the
# rest bucket beside the cross-entropy's).
RECOVERY_TRAIN_LINES = 600
RECOVERY_STEPS = 3
RECOVERY_LOSSES = ("cross_entropy", "distill")


# About 1B parameters (0.94 B): Llama-3.2-1B's layer (hidden 2048, 32 heads over 8 key/value heads), a
# 5632-wide FFN, 18 layers and a 32000-token vocabulary (the tokenizer uses the first 4096).
ONE_B = {"hidden": 2048, "layers": 18, "ffn": 5632, "heads": 32, "kv_heads": 8, "vocab": 32000}
# About 0.5B (0.50 B, 956 MiB), the test's: the same kind of layer, narrower and fewer.
HALF_B = {"hidden": 1536, "layers": 16, "ffn": 4096, "heads": 24, "kv_heads": 8, "vocab": 32000}


def job_settings(datasets_dir: str, compensation: str = "none") -> dict[str, Any]:
    """Ratio 0.3, 2 windows of 32 tokens of PTB train, diagonal solver, uniform allocation, no evaluation: every
    stage that holds weights (load, calibration, masking, surgery, verification, the checkpoint), in minutes."""
    return {
        "ratio": 0.3,
        "solver": "diagonal",
        "allocation": "uniform",
        "compensation": compensation,
        "device": "cpu",
        "datasets_dir": datasets_dir,
        "calibration": {"dataset": "ptb:train", "n_samples": 2, "seq_len": 32, "batch_size": 2},
        "evaluation": {"perplexity": []},
    }


def real_model_settings(
    datasets_dir: str, n_samples: int, seq_len: int, evaluation_limit: int | None = None
) -> dict[str, Any]:
    """`casp prune --ratio 0.2 --calibration-dataset <WikiText-2 valid file> --n-samples N --seq-len L --export gguf
    --gguf-type q4_k_m` on the CPU (#37's command), every other setting its default; `evaluation_limit` keeps
    that many perplexity windows per text (the slow test's, for time: the batches, and so the memory, are the
    same)."""
    settings: dict[str, Any] = {
        "ratio": 0.2,
        "device": "cpu",
        "datasets_dir": datasets_dir,
        "calibration": {
            "dataset": str(Path(datasets_dir) / "wikitext-2" / "wiki.valid.tokens"),
            "n_samples": n_samples,
            "seq_len": seq_len,
        },
        "export": ["gguf"],
        "gguf_type": "q4_k_m",
    }
    if evaluation_limit is not None:
        settings["evaluation"] = {"limit": evaluation_limit}
    return settings


def recovery_settings(datasets_dir: str, train_file: str, loss: str) -> dict[str, Any]:
    """`real_model_settings` at ratio 0.3, 32 x 512 calibration tokens and one perplexity window a text, no export,
    then LoRA recovery with `loss` at its default batch and sequence length, `RECOVERY_STEPS` steps of one pass."""
    settings = real_model_settings(datasets_dir, 32, 512, evaluation_limit=1)
    del settings["export"], settings["gguf_type"]
    recovery = {"method": "lora", "loss": loss, "dataset": train_file, "max_steps": RECOVERY_STEPS, "grad_accum": 1}
    return {**settings, "ratio": 0.3, "recovery": recovery}


def model_bytes(model: str) -> int:
    """The bytes of the model's parameters at the dtype the job loads it in on the CPU (a GGUF file's: float32),
    counted on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from casp_core.artifacts.gguf.source import is_gguf_reference

    config = gguf_config(Path(model)) if is_gguf_reference(model) else AutoConfig.from_pretrained(model)
    dtype = torch.float32 if is_gguf_reference(model) else config.dtype
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return sum(p.numel() * p.element_size() for p in skeleton.parameters())


def write_model(directory: Path, shape: dict[str, int], models_dir: str) -> int:
    """A random bfloat16 LLaMA of `shape` written with `save_pretrained`; returns the bytes of its weights."""
    torch.manual_seed(0)
    config = llama_config(**shape)
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    AutoTokenizer.from_pretrained(Path(models_dir) / "ptbwiki-7M").save_pretrained(directory)
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def measure(model: Path | str, settings: dict[str, Any]) -> dict[str, Any]:
    """Runs the job in a fresh process with a cache folder of its own: its peak RSS (MiB), the peak reached during
    each stage, and the load average before and after (other work slows it, and its figures say when)."""
    with tempfile.TemporaryDirectory() as out:
        load_before = os.getloadavg()
        figures = run_child(
            "bench.memory",
            ["--job", str(model), json.dumps(settings), str(Path(out) / "o")],
            "the job",
            env={**os.environ, "CASP_CACHE_DIR": str(Path(out) / "cache")},  # casp_core.artifacts.caches
        )
    return {**figures, "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}


class SampledRun(Run):
    """A run whose resident memory is read every `SAMPLE_SECONDS` and charged to the stage running then (the
    stage timer's ru_maxrss is the process's peak so far, which cannot say which stage reached it)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = "load"
        self.peaks: dict[str, float] = {}
        self.done = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def stage(self, name: str) -> AbstractContextManager[None]:
        self.current = name
        return super().stage(name)

    def _sample(self) -> None:
        while not self.done.wait(SAMPLE_SECONDS):
            self.peaks[self.current] = max(self.peaks.get(self.current, 0.0), memory_status_mib("VmRSS"))


def memory_status_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS: resident now; VmHWM: the peak of it)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(f"{field}:")).split()[1]) / 1024


SAMPLE_SECONDS = 0.02


def run_job_here(model_dir: str, settings: str, out: str) -> None:
    from casp_core.job.run import run_job
    from casp_core.settings import PruneConfig

    start = time.perf_counter()
    run = SampledRun()
    run_job(model_dir, PruneConfig(**json.loads(settings)), Path(out), run)
    run.done.set()
    report = json.loads((Path(out) / "report.json").read_text())
    print(
        json.dumps(
            {
                # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forked parent across exec, so under a
                # large pytest process it would report the parent's size, not the job's.
                "peak_rss_mib": memory_status_mib("VmHWM"),
                "seconds": time.perf_counter() - start,
                "stage_peak_rss_mib": run.peaks,
                # What the job's report says: the file it pruned, and the perplexities it measured.
                "report": {key: report.get(key) for key in ("source", "perplexity", "achieved_ratio")},
            }
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", nargs=3, metavar=("MODEL", "SETTINGS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--parts",
        default="random,real,recovery",
        help="comma-separated: random (the random shape), real (SmolLM2's prune), recovery (SmolLM2's recovery)",
    )
    parser.add_argument("--shape", choices=("1b", "0.5b"), default="1b")
    parser.add_argument(
        "--calibrations",
        default=",".join(f"{n}x{length}" for n, length in REAL_MODEL_CALIBRATIONS),
        help="the real model's calibrations, n_samples x seq_len, comma-separated",
    )
    parser.add_argument(
        "--evaluation-limit",
        type=int,
        help="the real model's perplexity windows per text (default: every window); the batches, so the memory, "
        "are the same, the time much shorter",
    )
    parser.add_argument("--datasets-dir", default=default_datasets_dir())
    parser.add_argument("--models-dir", default=default_models_dir())
    args = parser.parse_args(argv)
    if args.job:
        run_job_here(*args.job)
        return
    parts = args.parts.split(",")
    random_shape = measure_random_shape(ONE_B if args.shape == "1b" else HALF_B, args) if "random" in parts else None
    real_model = None
    if "real" in parts:
        calibrations = [tuple(int(n) for n in item.split("x")) for item in args.calibrations.split(",")]
        real_model = measure_real_model(calibrations, args)
    recovery = measure_recovery(args) if "recovery" in parts else None
    # Read only now: another run of the bench may have written its part meanwhile (a 128 x 2048 job takes hours).
    path = RESULTS_DIR / "memory.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    if random_shape is not None:
        result["random_shape"] = random_shape
    if real_model is not None:
        earlier_runs = result.get("real_model", {}).get("runs", {})
        result["real_model"] = {**real_model, "runs": {**earlier_runs, **real_model["runs"]}}
    if recovery is not None:
        earlier_runs = result.get("recovery", {}).get("runs", {})
        result["recovery"] = {**recovery, "runs": {**earlier_runs, **recovery["runs"]}}
    if "recovery" in result:  # the estimate changes with casp_core even where the rows are not measured again
        result["recovery"]["estimates_now"] = recovery_estimates_now(args.models_dir, args.datasets_dir)
    write_json(path, result)
    lines = [
        "# Peak host memory of a pruning job",
        "",
        *(random_shape_lines(result["random_shape"]) if "random_shape" in result else []),
        *(real_model_lines(result["real_model"]) if "real_model" in result else []),
        *(recovery_lines(result["recovery"]) if "recovery" in result else []),
    ]
    (RESULTS_DIR / "memory.md").write_text("\n".join(lines))
    print("\n".join(lines))


def measure_random_shape(shape: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    machine = machine_info()
    model_dir = Path(tempfile.mkdtemp(prefix="casp-memory-"))
    runs = {}
    try:
        size = write_model(model_dir, shape, args.models_dir)
        for compensation in COMPENSATIONS:
            settings = job_settings(args.datasets_dir, compensation)
            figures = measure(model_dir, settings)
            runs[compensation] = {"settings": {k: v for k, v in settings.items() if k != "datasets_dir"}, **figures}
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    size_mib = size / 2**20
    for figures in runs.values():
        figures["peak_over_weights"] = figures["peak_rss_mib"] / size_mib
        figures["peak_minus_factor_x_weights_mib"] = figures["peak_rss_mib"] - RSS_FACTOR * size_mib
    return {
        "machine": finish_machine_info(machine),
        "shape": shape,
        "weights_mib": size_mib,
        "bound_mib": rss_bound_mib(size_mib),
        "bound": f"{RSS_FACTOR} x weights + {RSS_MARGIN_MIB} MiB",
        "runs": runs,
    }


def measure_real_model(calibrations: list[tuple[int, ...]], args: argparse.Namespace) -> dict[str, Any]:
    """Each calibration's job, its machine and load beside it."""
    model = Path(args.models_dir) / SMOLLM2_GGUF
    model_mib = model_bytes(str(model)) / 2**20
    runs = {}
    for n_samples, seq_len in calibrations:
        machine = machine_info()
        settings = real_model_settings(args.datasets_dir, n_samples, seq_len, args.evaluation_limit)
        figures = measure(model, settings)
        runs[f"{n_samples}x{seq_len}"] = {
            "machine": finish_machine_info(machine),
            "settings": {k: v for k, v in settings.items() if k != "datasets_dir"},
            **figures,
        }
    return {
        "model": str(SMOLLM2_GGUF),
        "model_mib": model_mib,
        "bound_mib": job_bound_mib(model_mib),
        "bound": f"{JOB_FACTOR:g} x the model's bytes at its dtype + {JOB_MARGIN_BYTES / 1e9:g} GB",
        "runs": runs,
    }


def measure_recovery(args: argparse.Namespace) -> dict[str, Any]:
    """Each loss's job, with the recovery's estimate and the whole batch's logits beside its peak."""
    model = Path(args.models_dir) / SMOLLM2_GGUF
    lines = (Path(args.datasets_dir) / "ptb" / "ptb.train.txt").read_text(encoding="utf-8").splitlines()
    shape = smollm2_shape(args.models_dir)
    runs = {}
    with tempfile.TemporaryDirectory() as directory:
        train_file = Path(directory) / "ptb-train-head.txt"
        train_file.write_text("\n".join(lines[:RECOVERY_TRAIN_LINES]), encoding="utf-8")
        for loss in RECOVERY_LOSSES:
            machine = machine_info()
            settings = recovery_settings(args.datasets_dir, str(train_file), loss)
            recovery = RecoveryConfig(**settings["recovery"])
            figures = measure(model, settings)
            machine = finish_machine_info(machine)
            recorded = {**settings["recovery"], "dataset": f"ptb.train.txt, first {RECOVERY_TRAIN_LINES} lines"}
            # The float32 copies of the whole batch's logits the loss held before it took them a chunk at a time.
            copies = CROSS_ENTROPY_LOGITS if loss == CROSS_ENTROPY_LOSS else DISTILLATION_LOGITS
            batch_logits = recovery.batch_size * recovery.max_seq_len * shape.vocab * 4 * copies
            runs[f"{loss}, {(machine['git_commit'] or 'unknown')[:7]}"] = {
                "machine": machine,
                "settings": {k: v for k, v in settings.items() if k != "datasets_dir"} | {"recovery": recorded},
                "estimate_mib": estimate_recovery_memory(shape, recovery, 0.3, autocast=False).peak / 2**20,
                "batch_logits_mib": batch_logits / 2**20,
                **figures,
            }
    return {"model": str(SMOLLM2_GGUF), "model_mib": model_bytes(str(model)) / 2**20, "runs": runs}


def smollm2_shape(models_dir: str) -> ModelShape:
    """float32 on the CPU (a GGUF file is dequantized), sdpa attention (no score matrix kept)."""
    return ModelShape.from_config(gguf_config(Path(models_dir) / SMOLLM2_GGUF), dtype_bytes=4, eager_attention=False)


def recovery_estimates_now(models_dir: str, datasets_dir: str) -> dict[str, Any]:
    """Each loss's estimate by the casp_core that renders the table (a row's own is its commit's)."""
    shape = smollm2_shape(models_dir)
    estimates = {}
    for loss in RECOVERY_LOSSES:
        recovery = RecoveryConfig(**recovery_settings(datasets_dir, "ptb:train", loss)["recovery"])
        estimates[loss] = estimate_recovery_memory(shape, recovery, 0.3, autocast=False).peak
    return {"commit": git_commit(), "mib": {loss: peak / 2**20 for loss, peak in estimates.items()}}


def random_shape_lines(part: dict[str, Any]) -> list[str]:
    runs, size_mib = part["runs"], part["weights_mib"]
    return [
        "## A random 1B shape, no evaluation",
        "",
        machine_line(part["machine"]),
        "",
        f"Random LLaMA {part['shape']}, bfloat16, {size_mib:.0f} MiB of safetensors; `run_job` on the CPU, ratio "
        "0.3, diagonal solver, uniform allocation, 2 x 32 calibration tokens, no evaluation; in a fresh process. "
        f"Bound: {part['bound']} = {part['bound_mib']:.0f} MiB.",
        "",
        *(
            f"- compensation {name}: peak RSS **{figures['peak_rss_mib']:.0f} MiB** = "
            f"{figures['peak_over_weights']:.2f} x the weights = {RSS_FACTOR} x + "
            f"{figures['peak_minus_factor_x_weights_mib']:.0f} MiB, {figures['seconds']:.0f} s"
            for name, figures in runs.items()
        ),
        "",
        *stage_table(runs, "compensation"),
    ]


def real_model_lines(part: dict[str, Any]) -> list[str]:
    runs, bound = part["runs"], part["bound_mib"]
    return [
        "## SmolLM2-135M, the whole `casp prune`",
        "",
        f"`{part['model']}`, dequantized to float32: {part['model_mib']:.0f} MiB of weights. `casp prune --ratio 0.2` "
        "on the CPU with the WikiText-2 validation file as calibration text, every other setting its default "
        "(gradient allocation, least squares, perplexity of the dense and the pruned model on WikiText-2 and PTB in "
        f"batches of 8 x 2048 tokens), and, from the 128 x 2048 row on, `--export gguf --gguf-type q4_k_m` (#37's "
        f"command); in a fresh process with an empty cache. Bound: {part['bound']} = "
        f"**{bound:.0f} MiB**, for every stage.",
        "",
        *(
            f"- {name} calibration tokens: peak RSS **{figures['peak_rss_mib']:.0f} MiB** = "
            f"{figures['peak_rss_mib'] / bound:.2f} x the bound, {figures['seconds'] / 60:.0f} min{windows(figures)} "
            f"at load {figures['loadavg_before'][0]:.1f} before and {figures['loadavg_after'][0]:.1f} after (1-minute "
            f"load averages). {machine_line(figures['machine'])}"
            for name, figures in runs.items()
        ),
        "",
        *stage_table(runs, "calibration"),
    ]


def recovery_lines(part: dict[str, Any]) -> list[str]:
    runs, now = part["runs"], part["estimates_now"]
    return [
        "## SmolLM2-135M, recovery",
        "",
        f"`{part['model']}` (float32: {part['model_mib']:.0f} MiB) pruned by 0.3 (32 x 512 calibration tokens of the "
        "WikiText-2 validation file, one perplexity window a text), then LoRA recovery at its defaults (rank 8 on "
        f"every projection, batch 8 x 256 tokens, no gradient checkpointing) for {RECOVERY_STEPS} steps of one "
        f"pass on PTB train's first {RECOVERY_TRAIN_LINES} lines, with each loss; the whole job in a fresh process "
        "with an empty cache. Estimate: casp_core.method.placement's for the recovery at these settings in float32. "
        "Batch logits: the float32 logits of one batch as many times as the loss held them when it took the whole "
        "batch's at once (three copies, six with distillation); since 3f50cee the loss takes them a chunk of "
        "positions at a time (64 MiB), recomputed in the backward pass. A row's commit is the casp_core it ran, "
        "and its estimate that casp_core's.",
        "",
        f"The estimate of casp_core at {str(now['commit'])[:10]}, for these settings: "
        + ", ".join(f"**{mib:.0f} MiB** with {loss}" for loss, mib in now["mib"].items())
        + ".",
        "",
        "| loss, commit | recovery stage peak RSS (MiB) | estimate (MiB) | batch logits (MiB) | job peak RSS (MiB) | "
        "minutes | load before / after | machine |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {name} | **{figures['stage_peak_rss_mib'].get('recovery', float('nan')):.0f}** | "
            f"{figures['estimate_mib']:.0f} | {figures['batch_logits_mib']:.0f} | {figures['peak_rss_mib']:.0f} | "
            f"{figures['seconds'] / 60:.1f} | {figures['loadavg_before'][0]:.1f} / {figures['loadavg_after'][0]:.1f} "
            f"| {machine_line(figures['machine'])} |"
            for name, figures in runs.items()
        ),
        "",
        *stage_table(runs, "loss"),
    ]


def windows(figures: dict[str, Any]) -> str:
    """What a run's evaluation covered, where --evaluation-limit cut it (its batches, so its memory, are the same)."""
    limit = figures["settings"].get("evaluation", {}).get("limit")
    return f" (the perplexity over the first {limit} windows of each text)" if limit is not None else ""


def stage_table(runs: dict[str, dict[str, Any]], varied: str) -> list[str]:
    stages = list(dict.fromkeys(name for figures in runs.values() for name in figures["stage_peak_rss_mib"]))
    return [
        f"| stage | {' | '.join(f'peak RSS sampled during it, {varied} {name} (MiB)' for name in runs)} |",
        f"|---|{'---|' * len(runs)}",
        *(
            f"| {stage} | "
            + " | ".join(
                f"{figures['stage_peak_rss_mib'][stage]:.0f}" if stage in figures["stage_peak_rss_mib"] else "-"
                for figures in runs.values()
            )
            + " |"
            for stage in stages
        ),
        "",
    ]


if __name__ == "__main__":
    main()
