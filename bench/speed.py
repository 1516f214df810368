"""Speed bench: time and peak memory of each CASP stage on randomly initialised LLaMA-shaped models.

The cost of every stage depends on the shapes, not on the weights' values, so random weights and random
calibration tokens measure what a real model of the same shape would cost. Each stage is also given as a
ratio to the bare torch operation it is built on, so that runs on different machines compare. Each model
size runs in its own process, so that one size's memory does not show in the next one's figures.
Writes bench/results/speed.json and speed.md.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional
from transformers import AutoTokenizer, LlamaForCausalLM

from bench.common import (
    REPO_ROOT,
    RESULTS_DIR,
    all_finite,
    concurrency_note,
    default_models_dir,
    finish_machine_info,
    machine_info,
    machine_line,
    write_json,
)
from bench.shapes import llama_config
from casp_core.artifacts.checkpoint import save_pruned
from casp_core.method.allocation import layer_sensitivities
from casp_core.method.calibration import capture_first_layer_inputs, record_inputs, run_layer
from casp_core.method.interaction import block_aggregate, interaction_matrix
from casp_core.method.solvers import greedy
from casp_core.method.surgery import LayerPruning, mask_layer, remove_units
from casp_core.model import attention_geometry, decoder_layers, return_freed_heap
from casp_core.run import Run

CPU = torch.device("cpu")
HEAD_DIM = 64
VOCAB = 1024  # small on purpose: the LM head is not a CASP stage, and a 32k head would dominate the CPU budget
DEFAULT_SIZES = ("256x2x688", "1024x2x2752", "2048x2x5504", "4096x1x11008")
MEMORY_BATCHES = (1, 2, 4, 8)
MEMORY_SIZE = "2048x1x5504"


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    ffn: int

    @classmethod
    def parse(cls, text: str) -> "Size":
        hidden, layers, ffn = (int(part) for part in text.split("x"))
        return cls(hidden, layers, ffn)

    def __str__(self) -> str:
        return f"{self.hidden}x{self.layers}x{self.ffn}"

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_DIM


def random_model(size: Size) -> LlamaForCausalLM:
    config = llama_config(hidden=size.hidden, layers=size.layers, ffn=size.ffn, heads=size.heads, vocab=VOCAB)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


# ---------------------------------------------------------------- measuring


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every millisecond by a thread.

    tracemalloc does not see torch's CPU allocations (they bypass Python's allocator), so RSS is the honest
    measure on the CPU; the sampling can miss a spike shorter than a millisecond.
    """

    def __init__(self) -> None:
        self.start = self.peak = 0
        self._running = False
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = _rss_bytes()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def delta_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def median_seconds(work: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


@contextmanager
def timed(record: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    record[name] = record.get(name, 0.0) + time.perf_counter() - start


# ---------------------------------------------------------------- one pass of the pipeline's stages


def pipeline_pass(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int, out_dir: Path) -> dict[str, Any]:
    """The stages of `casp_core.method.prune.prune`, called directly with a timer and a memory probe on each.

    Each layer prunes half its heads and channels with greedy; the baseline ops are timed beside them, under a
    memory probe of their own: the probe's sampling thread takes CPU time, so a stage timed with it and its
    baseline without would charge the stage for the probe.
    """
    seconds: dict[str, float] = {}
    baseline: dict[str, float] = {}
    memory: dict[str, float] = {}
    baseline_memory: dict[str, float] = {}

    def probe(name: str) -> PeakRSS:
        return _Probe(memory, name)

    def bare(name: str) -> PeakRSS:
        return _Probe(baseline_memory, name)

    with probe("allocation"), timed(seconds, "allocation"):
        layer_sensitivities(model, windows, batch_size=batch_size, device=CPU, run=Run())
    with torch.no_grad(), bare("allocation"), timed(baseline, "allocation"):
        for start in range(0, len(windows), batch_size):
            model(windows[start : start + batch_size], use_cache=False)

    with probe("calibration_forward"), timed(seconds, "calibration_forward"):
        inputs = capture_first_layer_inputs(model, windows, batch_size, CPU, CPU)
    prunings = []
    for layer in decoder_layers(model):
        sublayers = {"attn": layer.self_attn.o_proj, "mlp": layer.mlp.down_proj}
        with probe("statistics"), timed(seconds, "statistics"), record_inputs(sublayers) as moments:
            run_layer(layer, inputs, CPU, CPU)  # the pipeline's statistics stage: the forward, hooks folding in C
        with bare("statistics"), timed(baseline, "statistics"):
            _bare_linears(layer, inputs.batches)
            for module in sublayers.values():
                # Values do not matter to the cost: a random block of the sub-layer input's shape.
                rows = torch.randn(windows.numel(), module.in_features)
                torch.mm(rows.T, rows)

        geometry = attention_geometry(model, layer)
        with probe("q_build"), timed(seconds, "q_build"):
            q_heads = block_aggregate(
                interaction_matrix(layer.self_attn.o_proj.weight, moments["attn"].second_moment), geometry.head_dim
            )
            q_channels = interaction_matrix(layer.mlp.down_proj.weight, moments["mlp"].second_moment)
        with bare("q_build"), timed(baseline, "q_build"):
            for name, module in sublayers.items():
                w = module.weight.detach().to(moments[name].dtype)
                torch.mm(w.T, w)

        heads, channels = q_heads.shape[0] // 2, q_channels.shape[0] // 2
        with probe("solver"), timed(seconds, "solver"):
            pruning = LayerPruning(tuple(greedy(q_heads, heads).tolist()), tuple(greedy(q_channels, channels).tolist()))
        with bare("solver"), timed(baseline, "solver"):
            _argmin_add(q_heads, heads)
            _argmin_add(q_channels, channels)
        del moments, q_heads, q_channels

        mask_layer(layer, geometry, pruning)
        prunings.append(pruning)
        with probe("calibration_forward"), timed(seconds, "calibration_forward"):
            inputs.batches = run_layer(layer, inputs, CPU, CPU)  # sequential: the next layer sees this one pruned
        with bare("calibration_forward"), timed(baseline, "calibration_forward"):
            _bare_linears(layer, inputs.batches)
    del inputs

    # Surgery and its baseline both make new tensors, and each starts with the heap's free pages given back, so that
    # both fault their new memory in: run after the pipeline has freed its activations, surgery would reuse freed
    # heap pages (tensors under glibc's 32 MB mmap threshold) while the baseline, run while surgery's tensors hold
    # them, would fault in fresh ones; at 2048 x 5504 that made surgery look faster than a copy.
    return_freed_heap()
    with probe("surgery"), timed(seconds, "surgery"):
        pruned = remove_units(model, prunings)
    return_freed_heap()
    with bare("surgery"), timed(baseline, "surgery"):
        # What surgery makes: the pruned decoder layers' weights. The embeddings, final norm and head it shares
        # with the dense model, not copies, so the baseline does not copy them either.
        kept_weights = {name: tensor.clone() for name, tensor in decoder_layers(pruned).state_dict().items()}
    del kept_weights

    tokenizer = AutoTokenizer.from_pretrained(Path(default_models_dir()) / "stories260K")
    with tempfile.TemporaryDirectory(dir=out_dir) as directory:
        with probe("save"), timed(seconds, "save"):
            save_pruned(pruned, tokenizer, Path(directory) / "casp")
        with bare("save"), timed(baseline, "save"):
            # Tied tensors would make safetensors refuse; this model's are untied.
            save_file(pruned.state_dict(), str(Path(directory) / "bare.safetensors"))
    return {
        "seconds": seconds,
        "baseline_seconds": baseline,
        "peak_rss_delta_mb": memory,
        "baseline_peak_rss_delta_mb": baseline_memory,
    }


class _Probe(PeakRSS):
    """A PeakRSS that records the largest delta of each stage across its several entries."""

    def __init__(self, memory: dict[str, float], name: str) -> None:
        super().__init__()
        self.memory, self.name = memory, name

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.memory[self.name] = max(self.memory.get(self.name, 0.0), self.delta_mb)


@torch.no_grad()
def _bare_linears(layer: nn.Module, batches: list[torch.Tensor]) -> None:
    """The layer's seven projections on the same tokens: the matmul floor of a decoder layer's forward."""
    attention, mlp = layer.self_attn, layer.mlp
    for x in batches:
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
            functional.linear(x, linear.weight)
        gate = functional.linear(x, mlp.gate_proj.weight)
        functional.linear(x, mlp.up_proj.weight)
        functional.linear(gate, mlp.down_proj.weight)


def _argmin_add(q: torch.Tensor, k: int) -> None:
    """k times argmin + add of a row: the work greedy cannot avoid."""
    cost = q.diagonal().clone()
    for _ in range(k):
        cost.add_(q[int(torch.argmin(cost))])


def measure_size(size: Size, n_samples: int, seq_len: int, batch_size: int, repeats: int, out_dir: Path) -> dict:
    passes = []
    for _ in range(repeats):
        model = random_model(size)  # fresh: a pass masks the model in place
        windows = torch.randint(0, VOCAB, (n_samples, seq_len), generator=torch.Generator().manual_seed(0))
        passes.append(pipeline_pass(model, windows, batch_size, out_dir))
        del model
    stages = list(passes[0]["seconds"])
    result: dict[str, Any] = {
        "size": str(size),
        "hidden": size.hidden,
        "layers": size.layers,
        "ffn": size.ffn,
        "heads": size.heads,
        "vocab": VOCAB,
        "decoder_params": size.layers * (4 * size.hidden**2 + 3 * size.hidden * size.ffn),
        "calibration_tokens": n_samples * seq_len,
        "repeats": repeats,
        "stages": {},
    }
    for stage in stages:
        seconds = statistics.median(p["seconds"][stage] for p in passes)
        base = statistics.median(p["baseline_seconds"][stage] for p in passes)
        result["stages"][stage] = {
            "seconds": seconds,
            "all_seconds": [p["seconds"][stage] for p in passes],
            "baseline_seconds": base,
            "baseline_all_seconds": [p["baseline_seconds"][stage] for p in passes],
            # Each pass's stage over its own baseline: both ran under the same load, so these spread less.
            "pass_ratios": [
                p["seconds"][stage] / p["baseline_seconds"][stage] if p["baseline_seconds"][stage] > 0 else None
                for p in passes
            ],
            "ratio_to_baseline": seconds / base if base > 0 else None,
            "peak_rss_delta_mb": statistics.median(p["peak_rss_delta_mb"][stage] for p in passes),
            "baseline_peak_rss_delta_mb": statistics.median(p["baseline_peak_rss_delta_mb"][stage] for p in passes),
        }
    return result


# ---------------------------------------------------------------- greedy at LLaMA2-7B's FFN width


def greedy_at_scale(d: int, k: int, repeats: int) -> dict[str, Any]:
    """Algorithm 1 at d = 11008, k = 5504 (LLaMA2-7B's down_proj, 50 %) on a random PSD Q in float32.

    The pipeline keeps Q in float32 above 4096 units, as here. Beside the total, one iteration's parts are
    timed alone, which says where the time goes if the target is missed.
    """
    torch.manual_seed(0)
    x = torch.randn(256, d)
    q = x.T @ x + torch.eye(d)  # PSD, full rank, float32
    total, runs = median_seconds(lambda: greedy(q, k), repeats)
    cost = q.diagonal().clone()
    steps = 200
    parts: dict[str, float] = {}
    with timed(parts, "argmin_and_int"):
        for _ in range(steps):
            int(torch.argmin(cost))
    with timed(parts, "row_add"):
        for i in range(steps):
            cost.add_(q[i], alpha=2.0)
    with timed(parts, "set_inf"):
        for i in range(steps):
            cost[i] = float("inf")
    bare, _ = median_seconds(lambda: _argmin_add(q, k), repeats)
    # CPU time of this thread with one torch thread: what the loop costs on an idle core, whatever else runs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu_times = []
    for _ in range(repeats):
        start = time.thread_time()
        greedy(q, k)
        cpu_times.append(time.thread_time() - start)
    torch.set_num_threads(threads)
    return {
        "d": d,
        "k": k,
        "dtype": str(q.dtype),
        "repeats": repeats,
        "median_seconds": total,
        "all_seconds": runs,
        "median_cpu_seconds_one_thread": statistics.median(cpu_times),
        "target_seconds": 1.0,
        "meets_target": total < 1.0,
        "bare_argmin_add_seconds": bare,
        "ratio_to_baseline": total / bare,
        "per_iteration_microseconds": {name: 1e6 * value / steps for name, value in parts.items()},
    }


# ---------------------------------------------------------------- calibration memory as the batch count grows


def memory_point(size: Size, batch_size: int, seq_len: int, count: int) -> float:
    """Peak RSS (MB above start) of capture + one layer's statistics pass + its sequential re-forward.

    Each point runs in a fresh process (see `calibration_memory`): memory freed by an earlier point would
    otherwise be reused by the allocator and hide the growth.
    """
    model = random_model(size)
    layer = decoder_layers(model)[0]
    windows = torch.randint(0, VOCAB, (count * batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    with PeakRSS() as peak:
        inputs = capture_first_layer_inputs(model, windows, batch_size, CPU, CPU)
        with record_inputs({"attn": layer.self_attn.o_proj, "mlp": layer.mlp.down_proj}):
            run_layer(layer, inputs, CPU, CPU)
        inputs.batches = run_layer(layer, inputs, CPU, CPU)
    return peak.delta_mb


def calibration_memory(size: Size, batch_size: int, seq_len: int, points: list[dict[str, float]]) -> dict[str, Any]:
    """Peak memory of a calibration pass against the batch count, and what it would be under each hypothesis.

    If the pipeline held every batch's activations at once, the peak would grow by the full per-batch
    footprint (attention scores, the FFN-wide intermediates) per batch. It should grow only by the hidden
    states kept on the store between layers (the input list and the output list being built: 2 x batch x
    seq x hidden floats per batch); the layer's weights, one batch's intermediates and the d x d statistics
    are a constant.
    """
    mb = 2**20
    hidden_per_batch = batch_size * seq_len * size.hidden * 4 / mb
    attention_scores = batch_size * size.heads * seq_len * seq_len * 4 / mb
    ffn_intermediates = 3 * batch_size * seq_len * size.ffn * 4 / mb  # gate, up, their product
    return {
        "size": str(size),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "points": points,
        "slope_mb_per_batch": _slope([p["batches"] for p in points], [p["peak_rss_delta_mb"] for p in points]),
        "model_mb": {
            "layer_weights": (4 * size.hidden**2 + 3 * size.hidden * size.ffn) * 4 / mb,
            "statistics": (size.hidden**2 + size.ffn**2) * 8 / mb,  # float64 C for o_proj and down_proj inputs
            "hidden_states_per_batch": hidden_per_batch,
            "store_growth_per_batch": 2 * hidden_per_batch,
            "one_batch_activations": hidden_per_batch * 5 + attention_scores + ffn_intermediates,
        },
    }


def _slope(xs: list[float], ys: list[float]) -> float:
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0


# ---------------------------------------------------------------- the markdown

STAGE_BASELINES = {
    "calibration_forward": "the layer's 7 projections (F.linear) on the same tokens",
    "statistics": "the layer's 7 projections plus one fp32 matmul rowsᵀ·rows per sub-layer over all tokens",
    "q_build": "one matmul WᵀW per sub-layer in the statistics' dtype",
    "allocation": "one no-grad forward of the whole model on the same windows",
    "solver": "k argmin + row add of the same size (heads and channels)",
    "surgery": "cloning the weights surgery makes (the pruned decoder layers'; not the shared embeddings and head)",
    "save": "safetensors.save_file of the same tensors",
}


def render_markdown(payload: dict[str, Any]) -> str:
    machine, settings = payload["machine"], payload["settings"]
    scale, memory = payload["greedy_at_scale"], payload["calibration_memory"]
    lines = [
        "# CASP speed bench",
        "",
        f"Machine: {machine_line(machine)}. {concurrency_note(machine)}",
        "",
        f"Randomly initialised LLaMA-shaped models (head size {HEAD_DIM}, vocabulary {VOCAB}), fp32 on the CPU, "
        f"calibration {settings['n_samples']} x {settings['seq_len']} random tokens in batches of "
        f"{settings['batch_size']}; each layer prunes half its heads and FFN channels with greedy. Seconds are "
        "medians over the repeats, summed over layers; memory is the peak RSS above the stage's start "
        "(sampled every ms; includes allocator slack). `ratio` is the stage's time over its bare torch "
        "operation's, timed beside it under the same memory probe:",
        "",
        *(f"- {stage}: {text}" for stage, text in STAGE_BASELINES.items()),
        "",
        "As in the pipeline's timer, `statistics` is a layer's forward with the hooks that fold each batch into "
        "C = E[YᵀY] (one per pruned sub-layer), and `calibration_forward` is the embedding pass plus each "
        "layer's re-forward once masked (sequential mode).",
        "",
        "| size (hidden x layers x ffn) | decoder params | repeats | " + " | ".join(STAGE_BASELINES) + " |",
        "|---|---|---|" + "---|" * len(STAGE_BASELINES),
    ]
    for size in payload["sizes"]:
        cells = []
        for stage in STAGE_BASELINES:
            s = size["stages"][stage]
            ratio = f"{s['ratio_to_baseline']:.2f}" if s["ratio_to_baseline"] is not None else "-"
            cells.append(f"{s['seconds']:.3f} s (x{ratio}), {s['peak_rss_delta_mb']:.0f} MB")
        lines.append(
            f"| {size['size']} | {size['decoder_params'] / 1e6:.1f} M | {size['repeats']} | " + " | ".join(cells) + " |"
        )
    verdict = "meets" if scale["meets_target"] else "misses"
    parts = ", ".join(f"{name} {value:.1f} µs" for name, value in scale["per_iteration_microseconds"].items())
    lines += [
        "",
        "## Greedy at LLaMA2-7B's FFN width",
        "",
        f"`casp_core.method.solvers.greedy` at d = {scale['d']}, k = {scale['k']} ({scale['dtype']}, random PSD Q): "
        f"median **{scale['median_seconds']:.3f} s** over {scale['repeats']} runs "
        f"({', '.join(f'{t:.3f}' for t in scale['all_seconds'])}) of wall time; it **{verdict}** the 1 s target "
        f"on this machine. Its CPU time with one torch thread (time.thread_time, which excludes time spent "
        f"waiting for a core) is {scale['median_cpu_seconds_one_thread']:.3f} s. "
        f"The bare k x (argmin + row add) loop in torch takes {scale['bare_argmin_add_seconds']:.3f} s "
        f"(ratio {scale['ratio_to_baseline']:.2f}). One torch iteration's parts, timed alone: {parts}. "
        "The loop is k sequential steps of O(d) work each, so per-call dispatch overhead, not arithmetic, "
        "sets its time; casp_core runs the same steps in NumPy, whose per-call overhead is a fraction of "
        "torch's, hence a ratio below 1.",
        "",
        "## Memory of a calibration pass",
        "",
        f"Model {memory['size']}, one decoder layer: capture of its inputs, its statistics pass and its "
        f"sequential re-forward, at a fixed batch of {memory['batch_size']} x {memory['seq_len']} tokens and a "
        "growing number of batches:",
        "",
        "| batches | peak RSS above start (MB) |",
        "|---|---|",
        *(f"| {p['batches']} | {p['peak_rss_delta_mb']:.0f} |" for p in memory["points"]),
        "",
        f"Measured growth: **{memory['slope_mb_per_batch']:.1f} MB per batch**. Expected if the pipeline keeps "
        f"only the hidden states between layers: {memory['model_mb']['store_growth_per_batch']:.1f} MB per batch "
        f"(input and output lists of {memory['model_mb']['hidden_states_per_batch']:.1f} MB each). One batch's "
        f"full activations are about {memory['model_mb']['one_batch_activations']:.0f} MB; holding every "
        "batch's activations at once would add that much per batch. The constant part is the layer's weights "
        f"({memory['model_mb']['layer_weights']:.0f} MB), one batch's activations and the d x d statistics "
        f"({memory['model_mb']['statistics']:.0f} MB in float64).",
        "",
        "How the pipeline does it (`casp_core/method/calibration.py`, `casp_core/method/prune.py`): "
        "`capture_first_layer_inputs` runs the embeddings "
        "with recorders in place of the decoder layers (they note each attention type's mask and rotary tables, "
        "and the last one needed stops the pass), keeping one hidden-state tensor per batch on the `store` device "
        "(the CPU). For each layer, `run_layer` moves one batch at a time to the "
        "device, runs the layer (the `record_inputs` hooks fold that batch into the d x d accumulators and drop "
        "it) and moves the output back to the store; the layer's weights go to the device before and back "
        "after. So the accelerator holds one layer, one batch and the statistics; the CPU store holds "
        "n_samples x seq_len x hidden hidden states (twice, briefly, while a layer's outputs replace its "
        "inputs), never the attention or FFN intermediates of more than one batch.",
        "",
        "## GPU: not measured",
        "",
        "No GPU was lent to this task, so the LLaMA2-7B-shaped whole-pipeline target (under 60 s on an "
        "H100/H200, peak GPU memory under 24 GB, 128 x 2048 calibration tokens) was **not measured**; nothing "
        "here supports or refutes it. `bench/gpu_llama7b.py` runs that measurement on a machine with a GPU.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="hidden x layers x ffn")
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large-repeats", type=int, default=1, help="repeats for sizes with hidden >= 4096")
    parser.add_argument("--greedy-d", type=int, default=11008)
    parser.add_argument("--greedy-repeats", type=int, default=5)
    parser.add_argument("--memory-size", default=MEMORY_SIZE)
    parser.add_argument("--memory-batches", nargs="+", type=int, default=list(MEMORY_BATCHES))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--in-process", action="store_true", help="no child processes (for quick tests)")
    parser.add_argument("--one", choices=("size", "memory"), help=argparse.SUPPRESS)  # a child process's task
    return parser.parse_args(argv)


def _child(args: argparse.Namespace, task: str, size: str, batches: int = 1) -> Any:
    """Run one measurement in a fresh interpreter: its peak memory is its own."""
    repeats = args.large_repeats if Size.parse(size).hidden >= 4096 else args.repeats
    if args.in_process:  # quick checks only: memory figures then share one process
        if task == "size":
            return measure_size(Size.parse(size), args.n_samples, args.seq_len, args.batch_size, repeats, args.out)
        return memory_point(Size.parse(size), args.batch_size, args.seq_len, batches)
    command = [sys.executable, "-m", "bench.speed", "--one", task, "--sizes", size, "--out", str(args.out)]
    command += ["--n-samples", str(args.n_samples), "--seq-len", str(args.seq_len)]
    command += ["--batch-size", str(args.batch_size), "--memory-batches", str(batches)]
    command += ["--repeats", str(repeats)]
    output = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one == "size":
        size = Size.parse(args.sizes[0])
        print(json.dumps(measure_size(size, args.n_samples, args.seq_len, args.batch_size, args.repeats, args.out)))
        return {}
    if args.one == "memory":
        size = Size.parse(args.sizes[0])
        print(json.dumps(memory_point(size, args.batch_size, args.seq_len, args.memory_batches[0])))
        return {}
    machine = machine_info()
    start = time.perf_counter()
    sizes = []
    for size in args.sizes:
        sizes.append(_child(args, "size", size))
        print(f"size {size}: " + ", ".join(f"{k} {v['seconds']:.3f}s" for k, v in sizes[-1]["stages"].items()))
    points = [
        {"batches": count, "peak_rss_delta_mb": _child(args, "memory", args.memory_size, count)}
        for count in args.memory_batches
    ]
    memory = calibration_memory(Size.parse(args.memory_size), args.batch_size, args.seq_len, points)
    print(f"calibration memory: {memory['slope_mb_per_batch']:.1f} MB per batch")
    scale = greedy_at_scale(args.greedy_d, args.greedy_d // 2, args.greedy_repeats)
    print(f"greedy d={scale['d']} k={scale['k']}: {scale['median_seconds']:.3f}s")
    payload = {
        "sizes": sizes,
        "greedy_at_scale": scale,
        "calibration_memory": memory,
        "gpu": {"measured": False, "reason": "no GPU was lent to this task; run bench/gpu_llama7b.py on one"},
        "machine": finish_machine_info(machine),
        "settings": {
            "n_samples": args.n_samples,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "repeats": args.repeats,
            "large_repeats": args.large_repeats,
            "dtype": "float32",
            "device": "cpu",
            "head_dim": HEAD_DIM,
            "vocab": VOCAB,
            "total_seconds": time.perf_counter() - start,
        },
    }
    write_json(args.out / "speed.json", payload)
    (args.out / "speed.md").write_text(render_markdown(payload))
    if not all_finite(payload):
        raise SystemExit("speed bench produced a non-finite number; see speed.json")
    return payload


if __name__ == "__main__":
    main()
