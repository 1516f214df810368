"""The LLaMA2-7B-shaped whole-pipeline measurement, for a machine with a CUDA GPU.

Target (the issue): the whole `prune` + save under 60 s on an H100/H200, peak GPU memory under 24 GB, with
128 x 2048 calibration tokens. The model is randomly initialised with LLaMA2-7B's shapes (hidden 4096, 32
layers, FFN 11008, 32 heads, vocabulary 32000, fp16): the cost does not depend on the weights' values.
Calibration text is WikiText-2 test, tokenized by the stories260K tokenizer (ids < 512, valid for the
model's vocabulary); its content does not matter to the timing either.

Both placements are measured (`--placements`), each on a fresh model: the whole model resident on the GPU, and
offloaded one decoder layer at a time (casp_core.placement), each peak beside the memory model's estimate for it.
It reports what it measured, stage by stage, and whether the targets were met; it claims nothing when it
cannot run (no GPU: exit status 2). Writes bench/results/gpu_llama7b.json.
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
from casp_core.checkpoint import save_pruned
from casp_core.config import CalibrationConfig, PruneConfig
from casp_core.errors import DeviceMemoryTooSmall
from casp_core.placement import OFFLOAD, RESIDENT, JobShape, ModelShape, estimate_device_memory
from casp_core.prune import prune
from casp_core.run import Run, StageTimer

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
    payload = {
        "machine": {**machine_info(), "gpu": torch.cuda.get_device_name(torch.device("cuda"))},
        "settings": {**vars(args), "out": str(args.out), "model": "random LLaMA2-7B shape"},
        "modes": modes,
    }
    write_json(args.out / "gpu_llama7b.json", payload)
    return payload


def measure(placement: str, args: argparse.Namespace) -> dict[str, Any]:
    """One whole prune + save of a fresh model with the whole model resident on the GPU, or offloaded one layer
    at a time; the measured peak beside casp_core.placement's estimate for the same job."""
    device = torch.device("cuda")
    model = llama7b_shaped(getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(Path(args.models_dir) / "stories260K")
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
    )
    estimate = estimate_device_memory(ModelShape.of(model), JobShape.of(model, config))
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
    return {
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


if __name__ == "__main__":
    main()
