"""The LLaMA2-7B-shaped whole-pipeline measurement, for a machine with a CUDA GPU.

Target (the issue): the whole `prune` + save under 60 s on an H100/H200, peak GPU memory under 24 GB, with
128 x 2048 calibration tokens. The model is randomly initialised with LLaMA2-7B's shapes (hidden 4096, 32
layers, FFN 11008, 32 heads, vocabulary 32000, fp16): the cost does not depend on the weights' values.
Calibration text is WikiText-2 test, tokenized by the stories260K tokenizer (ids < 512, valid for the
model's vocabulary); its content does not matter to the timing either.

Both placements are measured (`--placements`), each on a fresh model: the whole model resident on the GPU, and
offloaded one decoder layer at a time (casp_core.method.placement), each peak beside the memory model's estimate for it.
After the resident prune, a few recovery steps (`--recovery lora|full|none`) train the pruned model, their peak
beside `estimate_recovery_memory`'s; a recovery the estimate says does not fit is refused before pruning, as a
job refuses it, and that refusal is the finding. It reports what it measured, stage by stage, and whether the
targets were met; it claims nothing when it cannot run (no GPU: exit status 2). Writes bench/results/gpu_llama7b.json.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from bench.common import RESULTS_DIR, default_datasets_dir, default_models_dir, machine_info, write_json
from bench.shapes import llama2_7b_config
from casp_core.artifacts.checkpoint import save_pruned
from casp_core.errors import DeviceMemoryTooSmall
from casp_core.method.placement import (
    OFFLOAD,
    RESIDENT,
    JobShape,
    ModelShape,
    PlacementPlan,
    check_recovery_fits,
    estimate_device_memory,
)
from casp_core.method.prune import prune
from casp_core.recovery.data import load_training_data
from casp_core.recovery.train import recover
from casp_core.run import Run, StageTimer
from casp_core.settings import RECOVERY_METHODS, CalibrationConfig, PruneConfig, RecoveryConfig

TARGET_SECONDS = 60.0
TARGET_PEAK_GPU_GB = 24.0


def llama7b_shaped(dtype: torch.dtype) -> LlamaForCausalLM:
    config = llama2_7b_config(dtype=dtype)
    torch.manual_seed(0)
    # Initialising 6.7B parameters on the GPU takes seconds, on the CPU minutes; the pipeline expects the
    # model on the CPU (it moves it to the device whole or one layer at a time), so it goes back there afterwards.
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype)
    return model.to("cpu").eval()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--n-samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=CalibrationConfig().batch_size)
    parser.add_argument("--allocation", default="gradient", choices=("gradient", "uniform"))
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--datasets-dir", default=default_datasets_dir())
    parser.add_argument("--models-dir", default=default_models_dir())
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--placements", nargs="+", default=[RESIDENT, OFFLOAD], choices=(RESIDENT, OFFLOAD))
    parser.add_argument("--max-device-memory", default=None, help="bytes or 24GiB, ...; default: what the GPU has free")
    parser.add_argument("--recovery", default="lora", choices=RECOVERY_METHODS, help="after the resident prune")
    parser.add_argument("--recovery-steps", type=int, default=5, help="optimizer steps of the recovery measured")
    parser.add_argument("--recovery-seq-len", type=int, default=RecoveryConfig().max_seq_len)
    parser.add_argument("--recovery-batch-size", type=int, default=RecoveryConfig().batch_size)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing measured", file=sys.stderr)
        raise SystemExit(2)

    modes = {}
    for placement in args.placements:
        modes[placement] = measure(placement, args)
        mode = modes[placement]
        print(
            f"{placement}: total {mode['seconds_total']:.1f} s, peak GPU {mode['peak_gpu_gb']:.1f} GB "
            f"(estimated {mode['estimated_peak_gb']} GB), error: {mode['error']}"
        )
        if "recovery" in mode:
            trained = mode["recovery"]
            print(
                f"{placement} recovery ({args.recovery}): peak GPU {trained['peak_gpu_gb']} GB "
                f"(estimated {trained['estimated_peak_gb']} GB), error: {trained['error']}"
            )
    payload = {
        "machine": {**machine_info(), "gpu": torch.cuda.get_device_name(torch.device("cuda"))},
        "settings": {**vars(args), "out": str(args.out), "model": "random LLaMA2-7B shape"},
        "modes": modes,
    }
    write_json(args.out / "gpu_llama7b.json", payload)
    return payload


def measure(placement: str, args: argparse.Namespace) -> dict[str, Any]:
    """One whole prune + save of a fresh model with the whole model resident on the GPU, or offloaded one layer
    at a time; the measured peak beside casp_core.method.placement's estimate for the same job."""
    device = torch.device("cuda")
    model = llama7b_shaped(getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(Path(args.models_dir) / "stories260K")
    recovers = placement == RESIDENT and args.recovery != "none"
    config = PruneConfig(
        ratio=args.ratio,
        allocation=args.allocation,
        calibration=CalibrationConfig(
            dataset="wikitext2:test", n_samples=args.n_samples, seq_len=args.seq_len, batch_size=args.batch_size
        ),
        datasets_dir=args.datasets_dir,
        device="cuda",
        placement=placement,
        max_device_memory=args.max_device_memory,
        recovery=recovery_config(args) if recovers else RecoveryConfig(),
    )
    estimate = estimate_device_memory(ModelShape.of(model), JobShape.of(config, model.config))
    recovery_refusal = None
    if recovers:
        try:  # before pruning, as run_job checks it
            recovery_estimate = check_recovery_fits(
                model, config.recovery, config.ratio, PlacementPlan.of(config, model.config), device
            )
        except DeviceMemoryTooSmall as refused:
            recovery_refusal, recovers = str(refused), False
    estimated = estimate.resident_peak if placement == RESIDENT else estimate.offload_peak
    timer = StageTimer(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    error = None
    try:
        result = prune(model, tokenizer, config, Run(timer=timer))
        with timer.stage("save"), tempfile.TemporaryDirectory() as directory:
            save_pruned(result.model, tokenizer, Path(directory))
    except (torch.OutOfMemoryError, DeviceMemoryTooSmall) as refused:  # a finding, not a crash: say where
        error = f"{type(refused).__name__} after stages {list(timer.stages)}: {refused}"
    seconds = time.perf_counter() - start
    peak_gb = torch.cuda.max_memory_allocated(device) / 2**30
    del model
    recovery = {"error": recovery_refusal} if recovery_refusal else None
    if recovers and error is None:
        recovery = measure_recovery(result.model, tokenizer, config, recovery_estimate.peak, args)
    return {
        **({"recovery": recovery} if recovery else {}),
        "error": error,
        "seconds_total": seconds,
        "peak_gpu_gb": peak_gb,
        # What the memory model said before the run, to check it by: measured / estimated should stay below 1.
        "estimate_gb": {name: value / 2**30 for name, value in estimate.summary().items()},
        "estimated_peak_gb": round(estimated / 2**30, 2),
        "measured_over_estimated": peak_gb / (estimated / 2**30),
        "stages": timer.stages,
        "meets_time_target": error is None and seconds < TARGET_SECONDS,
        "meets_memory_target": error is None and peak_gb < TARGET_PEAK_GPU_GB,
    }


def recovery_config(args: argparse.Namespace) -> RecoveryConfig:
    """A few steps of the job's recovery on PTB train (tokenized by the stories260K tokenizer, like the calibration
    text): the memory of a step does not depend on how many follow."""
    return RecoveryConfig(
        method=args.recovery,
        dataset="ptb",
        max_steps=args.recovery_steps,
        grad_accum=1,
        batch_size=args.recovery_batch_size,
        max_seq_len=args.recovery_seq_len,
    )


def measure_recovery(
    pruned: LlamaForCausalLM, tokenizer: Any, config: PruneConfig, estimated: int, args: argparse.Namespace
) -> dict[str, Any]:
    """The pruned model's recovery steps on the GPU: the measured peak beside the estimate made before pruning."""
    device = torch.device("cuda")
    data = load_training_data(
        config.recovery.dataset,
        tokenizer,
        max_seq_len=config.recovery.max_seq_len,
        context=pruned.config.max_position_embeddings,
        datasets_dir=args.datasets_dir,
    )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    error = None
    try:
        recover(pruned, tokenizer, data, config.recovery, device="cuda")
    except torch.OutOfMemoryError as refused:  # the estimate was too low: the finding this step exists for
        error = f"OutOfMemoryError: {refused}"
    peak_gb = torch.cuda.max_memory_allocated(device) / 2**30
    return {
        "error": error,
        "settings": config.recovery.model_dump(),
        "seconds": time.perf_counter() - start,
        "peak_gpu_gb": round(peak_gb, 2),
        "estimated_peak_gb": round(estimated / 2**30, 2),
        "measured_over_estimated": peak_gb / (estimated / 2**30),
    }


if __name__ == "__main__":
    main()
