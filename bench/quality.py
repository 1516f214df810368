"""Quality bench: perplexity and objective of every solver x allocation, an alpha sweep (with alpha "auto"),
sequential vs dense, every score with and without least-squares compensation (FLAP also with its own mean-bias
compensation), and the price of the uniform shape (a plain LlamaForCausalLM) beside the per-layer result at the
same ratio.

Calibration is on `ptb:train` (in distribution for ptbwiki-7M, which was trained on PTB train + WikiText-2
valid); perplexity is on the held-out test splits `wikitext2` (raw test) and `ptb` (test), first
`--eval-windows` windows. Writes bench/results/quality.json and quality.md; with `--merge EARLIER.json`, the
rows of this run are added to an earlier result's (same calibration and evaluation settings), each recording the
run (machine, commit) it came from.

Two things every row of one model would recompute identically are computed once per model and shared:
the tokenized text (PTB train is 5 MB, ~10 s to tokenize here) and the allocation's gradient
sensitivities (they depend only on the dense model and the calibration windows, not on the ratio, solver
or alpha). Row `seconds` therefore excludes both; their one-off cost is in `settings.shared_seconds`.
"""

import argparse
import contextlib
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import casp_core.data
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
from casp_core.eval.perplexity import perplexity
from casp_core.eval.zeroshot import evaluate_zero_shot
from casp_core.method.allocation import layer_sensitivities
from casp_core.method.calibration import CalibrationPlan, calibration_windows
from casp_core.method.prune import prune
from casp_core.method.temperature import ALPHA_GRID
from casp_core.model import decoder_layers, load_config, load_model
from casp_core.rounding import auto_round_to, round_to_for
from casp_core.run import Run, StageTimer
from casp_core.settings import (
    AUTO_ALPHA,
    COMPENSATIONS,
    DENSE_TARGET_COMPENSATION,
    MEAN_BIAS_COMPENSATION,
    SOLVERS,
    ZERO_SHOT_TASKS,
    CalibrationConfig,
    PruneConfig,
)

MODELS = ("stories260K", "ptbwiki-7M")
RATIOS = (0.1, 0.2, 0.3, 0.5)
ALLOCATIONS = ("gradient", "uniform")
# auto's own grid, so that the best fixed alpha in hindsight is the best of what auto chooses from; then auto.
ALPHAS = (*ALPHA_GRID, AUTO_ALPHA)
MODES = ("sequential", "dense")
COMPENSATION_RATIOS = (0.2, 0.3, 0.5)
COMPENSATION_SOLVERS = ("greedy", "diagonal", "wanda_sp", "flap", "greedy_compensated")
SHAPE_RATIOS = (0.3, 0.5)
ROUNDING_RATIOS = (0.3, 0.5)
ROUNDINGS = (1, 8, 16)  # with auto's own multiple for each model's width (stories260K 1, ptbwiki-7M 8)
# Studies (1)-(6) keep every count exact (round_to 1, the default they were measured under); study (8) is the
# price of rounding.
EXACT_COUNTS = 1
# Rows written before the shape and rounding studies have no `shape` / `round_to`: they are per_layer, with exact
# counts (round_to 1, then the default).
FIELD_DEFAULTS = {"shape": "per_layer", "round_to": EXACT_COUNTS}
# Label in the results -> the source measured. PTB test, not the convention's default validation split: the
# bench's claim is about held-out text, and ptbwiki-7M's provenance names the PTB test split as held out.
EVAL_SETS = {"wikitext2": "wikitext2", "ptb": "ptb:test"}
CALIBRATION_SET = "ptb:train"
# The toy models' rows are at the paper's temperature, casp's default when they were measured; the default became 0.5
# on SmolLM2-135M (bench/results/smollm2.md), which the toy rows were never rerun at.
PAPER_ALPHA = 1.0
BATCH_SIZE = CalibrationConfig().batch_size


@dataclass(frozen=True)
class Spec:
    model: str
    ratio: float
    solver: str
    allocation: str
    alpha: float | str  # or AUTO_ALPHA
    mode: str
    compensation: str = "none"
    round_to: int | str = EXACT_COUNTS
    shape: str = "per_layer"


@dataclass(frozen=True)
class Settings:
    models_dir: str
    datasets_dir: str
    n_samples: int
    seq_len: int
    seed: int
    eval_seq_len: int
    eval_windows: int
    # Zero-shot accuracy of the dense models and of the compensation study's greedy rows (none: not measured).
    zero_shot_tasks: tuple[str, ...] = ()
    zero_shot_limit: int = 200

    def model_path(self, model: str) -> str:
        return str(Path(self.models_dir) / model)


def plan(
    models: Iterable[str],
    ratios: Iterable[float],
    solvers: Iterable[str],
    allocations: Iterable[str],
    alphas: Iterable[float | str],
    modes: Iterable[str],
    compensation_ratios: Iterable[float] = (),
    compensation_solvers: Iterable[str] = COMPENSATION_SOLVERS,
    compensations: Iterable[str] = COMPENSATIONS,
    shape_ratios: Iterable[float] = (),
    rounding_ratios: Iterable[float] = (),
    roundings: Iterable[int] = ROUNDINGS,
    ffn_widths: dict[str, int] | None = None,
) -> dict[Spec, list[str]]:
    """Each distinct run once, tagged with the studies that read it (the grid's greedy row is also alpha=1)."""
    runs: dict[Spec, list[str]] = {}
    models, modes, compensation_solvers = list(models), list(modes), list(compensation_solvers)
    compensations = list(compensations)
    for model in models:
        for ratio in ratios:
            for solver in solvers:
                for allocation in allocations:
                    spec = Spec(model, ratio, solver, allocation, PAPER_ALPHA, "sequential")
                    runs.setdefault(spec, []).append("grid")
            for alpha in alphas:
                runs.setdefault(Spec(model, ratio, "greedy", "gradient", alpha, "sequential"), []).append("alpha")
            for mode in modes:
                runs.setdefault(Spec(model, ratio, "greedy", "gradient", PAPER_ALPHA, mode), []).append("calibration")
        for ratio in compensation_ratios:
            for solver in compensation_solvers:
                for mode in modes:
                    for compensation in compensations:
                        if solver == "greedy_compensated" and compensation == "none":
                            continue  # its choice is made for the refit: without it, it has no claim
                        if compensation == MEAN_BIAS_COMPENSATION and solver != "flap":
                            continue  # FLAP's own compensation, measured as its paper has it
                        if compensation == DENSE_TARGET_COMPENSATION and mode == "dense":
                            continue  # one stream: the same fit as least_squares
                        spec = Spec(model, ratio, solver, "gradient", PAPER_ALPHA, mode, compensation)
                        runs.setdefault(spec, []).append("compensation")
        for ratio in shape_ratios:
            # Greedy per layer with either allocation, and the uniform shape (whose budget is uniform by nature).
            for allocation, shape in (("gradient", "per_layer"), ("uniform", "per_layer"), ("uniform", "uniform")):
                spec = Spec(model, ratio, "greedy", allocation, PAPER_ALPHA, "sequential", shape=shape)
                runs.setdefault(spec, []).append("shape")
        # The job's defaults (greedy, gradient, sequential, least squares) at each multiple; the one auto picks
        # for this model's width is run as `auto`.
        auto = auto_round_to((ffn_widths or {}).get(model, 1))
        for ratio in rounding_ratios:
            for multiple in dict.fromkeys([*roundings, auto]):
                round_to = "auto" if multiple == auto else multiple
                spec = Spec(model, ratio, "greedy", "gradient", PAPER_ALPHA, "sequential", "least_squares", round_to)
                runs.setdefault(spec, []).append("rounding")
    return runs


# ---------------------------------------------------------------- work shared by the rows of one model

_TOKENS: dict[str, torch.Tensor] = {}
_SENSITIVITIES: dict[str, list[float]] = {}
_tokenize = casp_core.data.tokenize


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _cached_tokenize(text: str, tokenizer: PreTrainedTokenizerBase, *, add_bos: bool) -> torch.Tensor:
    key = f"{tokenizer.name_or_path}|{add_bos}|{_digest(text.encode())}"
    if key not in _TOKENS:
        _TOKENS[key] = _tokenize(text, tokenizer, add_bos=add_bos)
    return _TOKENS[key]


def cached_sensitivities(model: PreTrainedModel, windows: torch.Tensor) -> list[float]:
    """The gradient allocation's S_l of the dense `model` on `windows`, measured once and handed to `prune`."""
    key = f"{model.config._name_or_path}|{BATCH_SIZE}|{_digest(windows.numpy().tobytes())}"
    if key not in _SENSITIVITIES:
        _SENSITIVITIES[key] = layer_sensitivities(
            model, windows, batch_size=BATCH_SIZE, device=torch.device("cpu"), run=Run()
        )
    return _SENSITIVITIES[key]


def install_caches(tokens: dict[str, torch.Tensor], sensitivities: dict[str, list[float]], threads: int) -> None:
    """Fill the caches and route the pipeline's tokenizer calls through them (also a worker's initializer)."""
    torch.set_num_threads(threads)
    _TOKENS.update(tokens)
    _SENSITIVITIES.update(sensitivities)
    casp_core.data.tokenize = _cached_tokenize


@contextlib.contextmanager
def caches_installed(threads: int) -> Iterator[None]:
    """The caches for this process only while the bench runs: a test session's other tests see casp_core as is."""
    previous_threads = torch.get_num_threads()
    install_caches({}, {}, threads)
    try:
        yield
    finally:
        casp_core.data.tokenize = _tokenize
        _TOKENS.clear()
        _SENSITIVITIES.clear()
        torch.set_num_threads(previous_threads)


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: Settings) -> dict[str, float]:
    return {
        name: perplexity(
            model,
            tokenizer,
            spec,
            seq_len=settings.eval_seq_len,
            datasets_dir=settings.datasets_dir,
            device="cpu",
            max_windows=settings.eval_windows,
        )["ppl"]
        for name, spec in EVAL_SETS.items()
    }


def zero_shot(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: Settings) -> dict[str, float]:
    """Accuracy per task over the first `zero_shot_limit` documents, and their mean."""
    tasks = evaluate_zero_shot(
        model,
        tokenizer,
        list(settings.zero_shot_tasks),
        limit=settings.zero_shot_limit,
        datasets_dir=settings.datasets_dir,
        device="cpu",
    )["tasks"]
    accuracies = {task: figures["acc"] for task, figures in tasks.items()}
    return {**accuracies, "mean": statistics.fmean(accuracies.values())}


def prepare_model(model_name: str, settings: Settings) -> dict[str, Any]:
    """Tokenize, compute the sensitivities and measure the dense model, once; fills the caches."""
    model, tokenizer = load_model(settings.model_path(model_name))
    start = time.perf_counter()
    text = casp_core.data.load_text(casp_core.data.parse_source(CALIBRATION_SET, "train"), settings.datasets_dir)
    tokens = casp_core.data.tokenize(text, tokenizer, add_bos=False)
    seq_len = min(settings.seq_len, model.config.max_position_embeddings)
    windows = casp_core.data.sample_windows(tokens, settings.n_samples, seq_len, settings.seed)
    tokenized = time.perf_counter()
    cached_sensitivities(model, windows)
    sensed = time.perf_counter()
    dense_ppl = evaluate(model, tokenizer, settings)
    return {
        "model": model_name,
        "ppl": dense_ppl,
        "zero_shot": zero_shot(model, tokenizer, settings) if settings.zero_shot_tasks else None,
        "eval_seq_len": settings.eval_seq_len,
        "max_windows": settings.eval_windows,
        "shared_seconds": {
            "tokenize_calibration": tokenized - start,
            "sensitivities": sensed - tokenized,
            "dense_evaluation_with_tokenizing": time.perf_counter() - sensed,
        },
    }


# ---------------------------------------------------------------- one row


def run(spec: Spec, studies: list[str], settings: Settings) -> dict[str, Any]:
    model, tokenizer = load_model(settings.model_path(spec.model))
    config = PruneConfig(
        ratio=spec.ratio,
        alpha=spec.alpha,
        solver=spec.solver,
        allocation=spec.allocation,
        compensation=spec.compensation,
        shape=spec.shape,
        round_to=spec.round_to,
        calibration=CalibrationConfig(
            dataset=CALIBRATION_SET,
            n_samples=settings.n_samples,
            seq_len=settings.seq_len,
            seed=settings.seed,
            mode=spec.mode,
            batch_size=BATCH_SIZE,
        ),
        datasets_dir=settings.datasets_dir,
        device="cpu",
    )
    timer = StageTimer(torch.device("cpu"))
    start = time.perf_counter()
    with timer.stage("calibration_data"):
        windows = calibration_windows(tokenizer, CalibrationPlan.of(config, model.config))
    with timer.stage("allocation"):
        uses_gradient = spec.allocation == "gradient" and spec.shape == "per_layer"
        sensitivities = cached_sensitivities(model, windows) if uses_gradient else None
    result = prune(model, tokenizer, config, Run(timer=timer), windows=windows, sensitivities=sensitivities)
    seconds = time.perf_counter() - start
    sublayers = [sub for layer in result.layers for sub in (layer.attn, layer.mlp)]
    bounds = [sub.lower_bound for sub in sublayers]
    return {
        "model": spec.model,
        "ratio": spec.ratio,
        "solver": spec.solver,
        "allocation": spec.allocation,
        "alpha": spec.alpha,
        "calibration_mode": spec.mode,
        "compensation": spec.compensation,
        "shape": spec.shape,
        # Per layer (one entry per distinct layer shape): query heads, key/value heads, FFN channels kept.
        "layer_shapes": sorted({layer_shape(layer) for layer in result.model.model.layers}),
        "round_to": spec.round_to,
        # The multiple every layer kept (auto's is the width's; the fixtures' layers all have one width).
        "ffn_multiple": round_to_for(model.config.intermediate_size, spec.round_to),
        "ffn_widths": [layer.mlp.down_proj.in_features for layer in decoder_layers(result.model)],
        "calibration_set": CALIBRATION_SET,
        "n_samples": settings.n_samples,
        "seq_len": settings.seq_len,
        "seed": settings.seed,
        "eval_seq_len": settings.eval_seq_len,
        "max_windows": settings.eval_windows,
        "ppl": evaluate(result.model, tokenizer, settings),
        "zero_shot": (
            zero_shot(result.model, tokenizer, settings)
            if settings.zero_shot_tasks and "compensation" in studies and spec.solver == "greedy"
            else None
        ),
        # Summed over layers of z'Qz for the chosen units (attention on the head-aggregated Q).
        "objective": sum(sub.objective for sub in sublayers),
        # The independent baseline on the same Q matrices: the fair yardstick for claim (1).
        "diagonal_objective": sum(sub.diagonal_objective for sub in sublayers),
        "lower_bound": sum(bounds) if all(b is not None for b in bounds) else None,
        "achieved_ratio": result.achieved_ratio,
        "seconds": seconds,
        "stage_seconds": {name: stage["seconds"] for name, stage in result.timings.items()},
        "studies": studies,
        "alpha_auto": result.temperature.summary() if result.temperature else None,
    }


def layer_shape(layer: torch.nn.Module) -> tuple[int, int, int]:
    attention = layer.self_attn
    heads = attention.q_proj.out_features // attention.head_dim
    return heads, attention.k_proj.out_features // attention.head_dim, layer.mlp.down_proj.in_features


def alpha_order(alpha: float | str) -> tuple[bool, float]:
    """Rows sort by alpha with "auto" after the numbers."""
    return (alpha == AUTO_ALPHA, 0.0 if alpha == AUTO_ALPHA else float(alpha))


def _cost(spec: Spec) -> tuple[int, int]:
    """Longest runs first, so that the workers finish together."""
    return (-MODELS.index(spec.model) if spec.model in MODELS else 0, spec.solver != "relaxation")


def run_all(
    runs: dict[Spec, list[str]], settings: Settings, jobs: int, threads: int, log: Callable[[str], None]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    dense = []
    for model_name in dict.fromkeys(spec.model for spec in runs):
        dense.append(prepare_model(model_name, settings))
        log(f"dense {model_name}: {dense[-1]['ppl']}")
    ordered = sorted(runs, key=_cost)
    rows = []
    with contextlib.ExitStack() as stack:
        if jobs > 1:
            pool = stack.enter_context(
                ProcessPoolExecutor(
                    max_workers=jobs,
                    mp_context=get_context("spawn"),
                    initializer=install_caches,
                    initargs=(dict(_TOKENS), dict(_SENSITIVITIES), threads),
                )
            )
            results: Iterable[dict[str, Any]] = (
                future.result() for future in [pool.submit(run, spec, runs[spec], settings) for spec in ordered]
            )
        else:
            results = (run(spec, runs[spec], settings) for spec in ordered)
        for row in results:
            rows.append(row)
            log(
                f"{row['model']} r={row['ratio']} {row['solver']}/{row['allocation']} a={row['alpha']} "
                f"{row['calibration_mode']} {row['compensation']} round_to {row['round_to']}: ppl {row['ppl']} "
                f"in {row['seconds']:.1f}s"
            )
    rows.sort(key=row_key)
    return rows, dense


# ---------------------------------------------------------------- the markdown


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"


def _select(rows: list[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    return [r for r in rows if all(r.get(k, FIELD_DEFAULTS.get(k)) == v for k, v in fields.items())]


def _one(rows: list[dict[str, Any]], **fields: Any) -> dict[str, Any] | None:
    found = _select(rows, **fields)
    return found[0] if found else None


def _verdict(wins: int, total: int) -> str:
    if total == 0:
        return "not measured"
    if wins == total:
        return f"holds ({wins}/{total})"
    if wins > total / 2:
        return f"mostly holds ({wins}/{total})"
    return f"does not hold ({wins}/{total})"


def _grid(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "grid" in r["studies"]]


def _section_objective(rows: list[dict[str, Any]]) -> list[str]:
    greedy = _select(_grid(rows), solver="greedy")
    strict = sum(r["objective"] < r["diagonal_objective"] for r in greedy)
    not_worse = sum(r["objective"] <= r["diagonal_objective"] * (1 + 1e-9) for r in greedy)
    relaxed = [r for r in _select(_grid(rows), solver="relaxation") if r["lower_bound"] is not None]
    lines = [
        "### (1) Greedy's objective below diagonal's",
        "",
        "Compared on the same Q matrices (each greedy run also scores the diagonal choice on its own Q; in "
        "sequential mode runs of different solvers see different Q after the first layer).",
        "",
        f"- Greedy strictly below diagonal: **{_verdict(strict, len(greedy))}**; "
        f"never above: {_verdict(not_worse, len(greedy))}.",
    ]
    if relaxed:
        gaps = [r["objective"] / r["lower_bound"] for r in relaxed if r["lower_bound"] > 0]
        lines.append(
            f"- Relaxation's projected solution vs its certified lower bound (same Q): objective / bound median "
            f"{_fmt(statistics.median(gaps)) if gaps else '-'} over {len(gaps)} runs."
        )
    lines += [
        "",
        "| model | ratio | allocation | greedy z'Qz | diagonal z'Qz (same Q) | greedy / diagonal | "
        "greedy_refine z'Qz | relaxation z'Qz | relaxation lower bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in greedy:
        key = {"model": r["model"], "ratio": r["ratio"], "allocation": r["allocation"]}
        refine = _one(_grid(rows), solver="greedy_refine", **key)
        relax = _one(_grid(rows), solver="relaxation", **key)
        share = r["objective"] / r["diagonal_objective"] if r["diagonal_objective"] else None
        lines.append(
            f"| {r['model']} | {r['ratio']} | {r['allocation']} | {_fmt(r['objective'])} | "
            f"{_fmt(r['diagonal_objective'])} | {_fmt(share)} | {_fmt(refine and refine['objective'])} | "
            f"{_fmt(relax and relax['objective'])} | {_fmt(relax and relax['lower_bound'])} |"
        )
    return [*lines, ""]


def _wins(rows: list[dict[str, Any]], better: dict[str, Any], worse: dict[str, Any], keys: tuple[str, ...]) -> str:
    """How often the `better` configuration has the lower perplexity than `worse`, per evaluation set."""
    parts = []
    for name in EVAL_SETS:
        wins = total = 0
        for row in _select(rows, **better):
            other = _one(rows, **worse, **{k: row[k] for k in keys})
            if other is not None:
                total += 1
                wins += row["ppl"][name] < other["ppl"][name]
        parts.append(f"{name}: {_verdict(wins, total)}")
    return "; ".join(parts)


def _ppl_table(rows: list[dict[str, Any]], dense: list[dict[str, Any]], solvers: list[str]) -> list[str]:
    dense_ppl = {d["model"]: f"{_fmt(d['ppl']['wikitext2'])} / {_fmt(d['ppl']['ptb'])}" for d in dense}
    lines = [
        "| model | ratio | allocation | dense | " + " | ".join(solvers) + " |",
        "|---|---|---|---|" + "---|" * len(solvers),
    ]
    for model, ratio, allocation in sorted({(r["model"], r["ratio"], r["allocation"]) for r in rows}):
        values = []
        for solver in solvers:
            row = _one(rows, model=model, ratio=ratio, allocation=allocation, solver=solver)
            values.append(f"{_fmt(row['ppl']['wikitext2'])} / {_fmt(row['ppl']['ptb'])}" if row else "-")
        lines.append(f"| {model} | {ratio} | {allocation} | {dense_ppl.get(model, '-')} | " + " | ".join(values) + " |")
    return lines


def _section_alpha(rows: list[dict[str, Any]]) -> list[str]:
    sweep = [r for r in rows if "alpha" in r["studies"] and r["alpha"] != AUTO_ALPHA]
    alphas = sorted({r["alpha"] for r in sweep})
    lines = [
        "### (4) The alpha trend (greedy, gradient allocation)",
        "",
        "The paper (LLaMA2-7B, 50 %) finds alpha = 1 best overall, alpha = 0.5 best on WikiText-2 alone, and "
        "1.5 / 2 worse. Here, wikitext2 / ptb perplexity:",
        "",
        "| model | ratio | " + " | ".join(f"alpha {a}" for a in alphas) + " | best (wikitext2, ptb) |",
        "|---|---|" + "---|" * (len(alphas) + 1),
    ]
    for model, ratio in sorted({(r["model"], r["ratio"]) for r in sweep}):
        cells = [_one(sweep, model=model, ratio=ratio, alpha=a) for a in alphas]
        present = [c for c in cells if c]
        best = ", ".join(str(min(present, key=lambda c, n=name: c["ppl"][n])["alpha"]) for name in EVAL_SETS)
        lines.append(
            f"| {model} | {ratio} | "
            + " | ".join(f"{_fmt(c['ppl']['wikitext2'])} / {_fmt(c['ppl']['ptb'])}" if c else "-" for c in cells)
            + f" | {best} |"
        )
    best_one = sum(
        min(_select(sweep, model=m, ratio=r), key=lambda c: c["ppl"]["wikitext2"] + c["ppl"]["ptb"])["alpha"]
        == PAPER_ALPHA
        for m, r in {(row["model"], row["ratio"]) for row in sweep}
    )
    cases = len({(row["model"], row["ratio"]) for row in sweep})
    lines += ["", f"- alpha = 1 has the lowest summed perplexity: **{_verdict(best_one, cases)}**.", ""]
    return lines


def _summed(row: dict[str, Any]) -> float:
    return sum(row["ppl"][name] for name in EVAL_SETS)


def _section_alpha_auto(rows: list[dict[str, Any]]) -> list[str]:
    automatic = [r for r in rows if r["alpha"] == AUTO_ALPHA]
    if not automatic:
        return []
    lines = [
        '### (4b) alpha "auto" against alpha = 1 and the best fixed alpha in hindsight',
        "",
        "auto holds out a quarter of the calibration windows and picks, from (0, 0.5, 1, 1.5, 2, 3), the temperature "
        "whose pruning (from dense statistics of the other windows) has the lowest held-out loss; the pruning then "
        "uses all windows. The best fixed alpha is the one with the lowest summed test perplexity among the fixed "
        "alphas run here (greedy, gradient allocation, sequential, same compensation). wikitext2 / ptb perplexity:",
        "",
        "| model | ratio | auto: chosen | auto | alpha 1 | best fixed (alpha) | held-out loss per alpha |",
        "|---|---|---|---|---|---|---|",
    ]
    beats_one = matches_best = 0
    for row in automatic:
        fixed = [
            r for r in _select(rows, model=row["model"], ratio=row["ratio"], solver=row["solver"],
                               allocation=row["allocation"], calibration_mode=row["calibration_mode"],
                               compensation=row["compensation"])
            if r["alpha"] != AUTO_ALPHA
        ]  # fmt: skip
        one = next((r for r in fixed if r["alpha"] == PAPER_ALPHA), None)
        best = min(fixed, key=_summed) if fixed else None
        beats_one += one is not None and _summed(row) <= _summed(one)
        matches_best += best is not None and _summed(row) <= _summed(best) * (1 + 1e-9)
        losses = ", ".join(f"{g['alpha']:g}: {g['held_out_loss']:.4f}" for g in row["alpha_auto"]["grid"])
        lines.append(
            f"| {row['model']} | {row['ratio']} | {row['alpha_auto']['chosen']:g} | "
            f"{_fmt(row['ppl']['wikitext2'])} / {_fmt(row['ppl']['ptb'])} | "
            + (f"{_fmt(one['ppl']['wikitext2'])} / {_fmt(one['ppl']['ptb'])}" if one else "-")
            + " | "
            + (f"{_fmt(best['ppl']['wikitext2'])} / {_fmt(best['ppl']['ptb'])} ({best['alpha']})" if best else "-")
            + f" | {losses} |"
        )
    lines += [
        "",
        f"- auto's summed perplexity at most alpha = 1's: **{_verdict(beats_one, len(automatic))}**; "
        f"equal to the best fixed alpha's: {_verdict(matches_best, len(automatic))}.",
        "",
    ]
    return lines


def _section_modes(rows: list[dict[str, Any]]) -> list[str]:
    study = [r for r in rows if "calibration" in r["studies"]]
    lines = [
        "### (5) Sequential vs dense calibration (greedy, gradient allocation)",
        "",
        f"- Sequential has the lower perplexity: **"
        f"{_wins(study, {'calibration_mode': 'sequential'}, {'calibration_mode': 'dense'}, ('model', 'ratio'))}**.",
        "",
        "| model | ratio | sequential | dense |",
        "|---|---|---|---|",
    ]
    for model, ratio in sorted({(r["model"], r["ratio"]) for r in study}):
        cells = [_one(study, model=model, ratio=ratio, calibration_mode=m) for m in MODES]
        lines.append(
            f"| {model} | {ratio} | "
            + " | ".join(f"{_fmt(c['ppl']['wikitext2'])} / {_fmt(c['ppl']['ptb'])}" if c else "-" for c in cells)
            + " |"
        )
    return [*lines, ""]


def _section_compensation(rows: list[dict[str, Any]], dense: list[dict[str, Any]]) -> list[str]:
    study = [r for r in rows if "compensation" in r["studies"]]
    if not study:
        return []
    keys = ("model", "ratio", "solver", "calibration_mode")
    wins = _wins(study, {"compensation": "least_squares"}, {"compensation": "none"}, keys)
    flap = _select(study, solver="flap")
    lines = [
        "### (6) Least-squares compensation of the kept units (gradient allocation, alpha 1), and FLAP's bias",
        "",
        "The kept columns of o_proj and down_proj refitted from the calibration statistics C (damping 0.01 x "
        "mean diagonal), against the same selection left as it was. FLAP's rows also have FLAP's own "
        "compensation (`bias`, as its paper has it): the removed columns' mean output W_p E[y_p] added to the "
        "o_proj / down_proj bias, the kept weights left as they were.",
        "",
        f"- With compensation the perplexity is lower: **{wins}** ((model, ratio, solver, calibration) cells).",
        "- FLAP + its bias against FLAP without compensation: **"
        + _wins(flap, {"compensation": MEAN_BIAS_COMPENSATION}, {"compensation": "none"}, keys)
        + "**; FLAP + least squares against FLAP + its bias: **"
        + _wins(flap, {"compensation": "least_squares"}, {"compensation": MEAN_BIAS_COMPENSATION}, keys)
        + "**.",
        "- Least squares towards the dense model's output (`least_squares_dense_target`, GPTAQ-style) against "
        "towards this layer's own output on the pruned inputs (`least_squares`), sequential calibration: **"
        + _wins(
            [r for r in study if r["calibration_mode"] == "sequential"],
            {"compensation": "least_squares_dense_target"},
            {"compensation": "least_squares"},
            keys,
        )
        + "** (in dense calibration mode the two are the same fit).",
        "- `greedy_compensated` (greedy on the error left after the refit) + least squares against CASP's greedy + "
        "least squares: **"
        + _wins(
            study,
            {"solver": "greedy_compensated", "compensation": "least_squares"},
            {"solver": "greedy", "compensation": "least_squares"},
            ("model", "ratio", "calibration_mode"),
        )
        + "**.",
        "",
        "| model | ratio | solver | calibration | " + " | ".join(COMPENSATIONS) + " |",
        "|---|---|---|---|" + "---|" * len(COMPENSATIONS),
    ]
    for model, ratio, solver, mode in sorted({tuple(r[k] for k in keys) for r in study}):
        cells = [
            _one(study, model=model, ratio=ratio, solver=solver, calibration_mode=mode, compensation=c)
            for c in COMPENSATIONS
        ]
        lines.append(
            f"| {model} | {ratio} | {solver} | {mode} | "
            + " | ".join(f"{_fmt(c['ppl']['wikitext2'])} / {_fmt(c['ppl']['ptb'])}" if c else "-" for c in cells)
            + " |"
        )
    return [*lines, *_zero_shot_table(study, dense), ""]


def _section_rounding(rows: list[dict[str, Any]], dense: list[dict[str, Any]]) -> list[str]:
    study = [r for r in rows if "rounding" in r["studies"]]
    if not study:
        return []
    lines = [
        "### (8) The price of rounding kept FFN widths (`round_to`; greedy, gradient, sequential, least squares)",
        "",
        "Kept FFN channels rounded to a multiple, against exact counts (round_to 1, the default before `auto`). "
        "`auto` is the default's multiple for the model's width (casp_core/rounding.py); the speed it buys is "
        "in engines.md. Perplexity wikitext2 / ptb, and its change against round_to 1.",
        "",
        "| model | ratio | round_to | multiple | achieved ratio | perplexity | change |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(study, key=lambda r: (r["model"], r["ratio"], r["ffn_multiple"])):
        exact = _one(study, model=r["model"], ratio=r["ratio"], ffn_multiple=1)
        change = " / ".join(f"{100 * (r['ppl'][n] / exact['ppl'][n] - 1):+.1f}%" for n in r["ppl"]) if exact else "-"
        lines.append(
            f"| {r['model']} | {r['ratio']} | {r['round_to']} | {r['ffn_multiple']} | {r['achieved_ratio']:.4f} | "
            f"{' / '.join(_fmt(v) for v in r['ppl'].values())} | {change} |"
        )
    return [*lines, ""]


def _zero_shot_table(study: list[dict[str, Any]], dense: list[dict[str, Any]]) -> list[str]:
    measured = [r for r in study if r.get("zero_shot")]
    if not measured:
        return []
    keys = ("model", "ratio", "calibration_mode")
    compensations = [c for c in COMPENSATIONS if _select(measured, compensation=c)]
    better = sum(
        _one(measured, compensation="least_squares", **{k: r[k] for k in keys})["zero_shot"]["mean"]
        > r["zero_shot"]["mean"]
        for r in _select(measured, compensation="none")
        if _one(measured, compensation="least_squares", **{k: r[k] for k in keys})
    )
    cells = len(_select(measured, compensation="none"))
    tasks = [t for t in measured[0]["zero_shot"] if t != "mean"]
    dense_means = ", ".join(f"{d['model']} {d['zero_shot']['mean']:.3f}" for d in dense if d.get("zero_shot"))
    return [
        "",
        f"Zero-shot accuracy of the greedy rows, mean over {', '.join(tasks)} (the settings give the documents per "
        f"task; dense: {dense_means}). Least squares has the higher mean in **{better} of {cells}** cells.",
        "",
        "| model | ratio | calibration | " + " | ".join(compensations) + " |",
        "|---|---|---|" + "---|" * len(compensations),
        *(
            f"| {model} | {ratio} | {mode} | "
            + " | ".join(
                f"{c['zero_shot']['mean']:.3f}" if c else "-"
                for c in (
                    _one(measured, model=model, ratio=ratio, calibration_mode=mode, compensation=name)
                    for name in compensations
                )
            )
            + " |"
            for model, ratio, mode in sorted({tuple(r[k] for k in keys) for r in measured})
        ),
    ]


def _section_shape(rows: list[dict[str, Any]], dense: list[dict[str, Any]]) -> list[str]:
    study = [r for r in rows if "shape" in r["studies"]]
    if not study:
        return []
    dense_ppl = {d["model"]: f"{_fmt(d['ppl']['wikitext2'])} / {_fmt(d['ppl']['ptb'])}" for d in dense}

    def cell(row: dict[str, Any] | None) -> str:
        return f"{_fmt(row['ppl']['wikitext2'])} / {_fmt(row['ppl']['ptb'])}" if row else "-"

    lines = [
        "### (7) The price of the uniform shape",
        "",
        "Greedy, sequential calibration, no compensation. Per layer (CASP's default: gradient allocation, and the "
        "same with uniform allocation) against the uniform shape: every layer keeps the same heads, key/value heads "
        "and FFN channels, saved as a plain LlamaForCausalLM (vLLM, TGI, llama.cpp `llama`). LlamaConfig takes "
        "only head counts that divide hidden_size (1, 2, 4, 8 on both models), so the uniform shape moves heads in "
        "coarse steps and the FFN channels take the rest. Kept shapes are (query heads, key/value heads, FFN "
        "channels).",
        "",
        "| model | ratio | dense | per layer, gradient | per layer, uniform allocation | uniform shape "
        "| uniform shape kept | achieved ratio (uniform shape) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, ratio in sorted({(r["model"], r["ratio"]) for r in study}):
        key = {"model": model, "ratio": ratio, "solver": "greedy", "calibration_mode": "sequential"}
        gradient = _one(study, allocation="gradient", shape="per_layer", **key)
        uniform_allocation = _one(study, allocation="uniform", shape="per_layer", **key)
        uniform = _one(study, shape="uniform", **key)
        kept = ", ".join(str(tuple(s)) for s in uniform["layer_shapes"]) if uniform else "-"
        achieved = f"{uniform['achieved_ratio']:.4f}" if uniform else "-"
        lines.append(
            f"| {model} | {ratio} | {dense_ppl.get(model, '-')} | {cell(gradient)} | {cell(uniform_allocation)} "
            f"| {cell(uniform)} | {kept} | {achieved} |"
        )
    return [*lines, ""]


def _studied(rows: list[dict[str, Any]], study: str) -> bool:
    return any(study in r["studies"] for r in rows)


def _grid_sections(grid: list[dict[str, Any]], rows: list[dict[str, Any]], baseline_lines: list[str]) -> list[str]:
    """Claims (1) to (3), read from the grid of solvers x allocations."""
    return [
        *_section_objective(rows),
        "### (2) Greedy perplexity vs the independent scores",
        "",
        "Count of (model, ratio, allocation) cells where greedy's perplexity is lower:",
        "",
        *baseline_lines,
        "",
        "### (3) Gradient allocation vs uniform",
        "",
        "Count of (model, ratio, solver) cells where gradient allocation's perplexity is lower:",
        "",
        f"- {_wins(grid, {'allocation': 'gradient'}, {'allocation': 'uniform'}, ('model', 'ratio', 'solver'))}",
        "",
    ]


def render_markdown(payload: dict[str, Any]) -> str:
    rows, dense, settings, machine = payload["rows"], payload["dense"], payload["settings"], payload["machine"]
    grid = _grid(rows)
    solvers = [s for s in SOLVERS if _select(grid, solver=s)]
    keys = ("model", "ratio", "allocation")
    baseline_lines = [
        f"- greedy vs {other}: {_wins(grid, {'solver': 'greedy'}, {'solver': other}, keys)}"
        for other in ("diagonal", "wanda_sp", "flap")
        if other in solvers
    ]
    lines = [
        "# CASP quality bench",
        "",
        f"Machine: {machine_line(machine)}. {concurrency_note(machine)}",
        *(
            f"Rows with `merged_run` {index} ({run['rows_added']} added, {run['rows_rerun']} rerun as a check: "
            f"largest relative perplexity difference {_fmt(run['rerun_max_relative_ppl_difference'])}): "
            f"{machine_line(run['machine'])}. {concurrency_note(run['machine'])}"
            for index, run in enumerate(payload.get("merged_runs", []))
        ),
        "",
        f"Calibration: `{settings['calibration_set']}`, {settings['n_samples']} x {settings['seq_len']} tokens, "
        f"seed {settings['seed']}. Perplexity: first {settings['eval_windows']} windows of "
        f"{settings['eval_seq_len']} tokens of `wikitext2` (raw test) and `ptb` (test), BOS once at the start. "
        "Every row's settings are in quality.json. Perplexities are written wikitext2 / ptb.",
        "",
        "These are two very small models (260K and 7M parameters) with a short calibration; the paper's "
        "claims are about LLaMA2-7B/13B. A claim that fails here is a finding about these models, "
        "not a refutation.",
        "",
        "## Claims",
        "",
        *(_grid_sections(grid, rows, baseline_lines) if grid else []),
        # A run of some studies only (`--ratios` with no value, ...) shows only theirs.
        *(_section_alpha(rows) if _studied(rows, "alpha") else []),
        *(_section_alpha_auto(rows) if _studied(rows, "alpha") else []),
        *(_section_modes(rows) if _studied(rows, "calibration") else []),
        *_section_compensation(rows, dense),
        *_section_shape(rows, dense),
        *_section_rounding(rows, dense),
        *(
            ["## All solvers x allocations (wikitext2 / ptb perplexity)", "", *_ppl_table(grid, dense, solvers), ""]
            if grid
            else []
        ),
        "## Runs",
        "",
        "| model | ratio | solver | allocation | alpha | calibration | compensation | shape | z'Qz | achieved ratio "
        "| seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['model']} | {r['ratio']} | {r['solver']} | {r['allocation']} | {r['alpha']} | "
            f"{r['calibration_mode']} | {r['compensation']} | {r.get('shape', FIELD_DEFAULTS['shape'])} | "
            f"{_fmt(r['objective'])} | {r['achieved_ratio']:.4f} | {r['seconds']:.1f} |"
            for r in rows
        ),
        "",
        "Row seconds are the `prune` call alone, excluding tokenization and the gradient sensitivities, which "
        f"are computed once per model: {settings['shared_seconds']}.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def alpha_value(text: str) -> float | str:
    return text if text == AUTO_ALPHA else float(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument(
        "--ratios", nargs="*", type=float, default=list(RATIOS), help="ratios of studies 1-5 (none: skip them)"
    )
    parser.add_argument("--solvers", nargs="+", default=list(SOLVERS), choices=SOLVERS)
    parser.add_argument("--allocations", nargs="+", default=list(ALLOCATIONS), choices=ALLOCATIONS)
    parser.add_argument(
        "--alphas", nargs="*", type=alpha_value, default=list(ALPHAS), help=f'numbers, or "{AUTO_ALPHA}"'
    )
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--compensation-ratios",
        nargs="*",
        type=float,
        default=list(COMPENSATION_RATIOS),
        help="ratios of the with/without compensation study (none: skip it)",
    )
    parser.add_argument("--compensation-solvers", nargs="+", default=list(COMPENSATION_SOLVERS), choices=SOLVERS)
    parser.add_argument(
        "--compensations",
        nargs="+",
        default=list(COMPENSATIONS),
        choices=COMPENSATIONS,
        help="the compensations of that study (bias runs with flap only)",
    )
    parser.add_argument(
        "--shape-ratios",
        nargs="*",
        type=float,
        default=list(SHAPE_RATIOS),
        help="ratios of the uniform shape's price (per layer vs uniform shape; none: skip it)",
    )
    parser.add_argument(
        "--rounding-ratios",
        nargs="*",
        type=float,
        default=list(ROUNDING_RATIOS),
        help="ratios of the round_to study (none: skip it)",
    )
    parser.add_argument("--roundings", nargs="+", type=int, default=list(ROUNDINGS), help="round_to values (and auto)")
    parser.add_argument(
        "--zero-shot",
        nargs="*",
        default=[],
        choices=ZERO_SHOT_TASKS,
        help="zero-shot tasks for the dense models and the compensation study's greedy rows",
    )
    parser.add_argument("--zero-shot-limit", type=int, default=200, help="documents per zero-shot task")
    parser.add_argument("--n-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-seq-len", type=int, default=128)
    parser.add_argument("--eval-windows", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (runs are independent)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--datasets-dir", default=default_datasets_dir())
    parser.add_argument("--models-dir", default=default_models_dir())
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--merge",
        type=Path,
        help="an earlier quality.json (or compensation.json) with the same calibration and evaluation settings: "
        "the result is its rows plus this run's; a row it already has is rerun as a check, not added",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with caches_installed(args.threads):
        return _main(args, argv)


ROW_KEY = ("model", "ratio", "solver", "allocation", "alpha", "calibration_mode", "compensation", "shape", "round_to")
# Settings two runs must share for their rows to sit in one table (jobs, threads and timings may differ).
COMPARABLE_SETTINGS = (
    "calibration_set", "n_samples", "seq_len", "seed", "batch_size", "eval_sets", "eval_seq_len", "eval_windows",
)  # fmt: skip


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """A row's identity, which also orders the rows (alpha "auto" after the numbers; round_to, a number or "auto",
    as text)."""
    values = {k: row.get(k, FIELD_DEFAULTS.get(k)) for k in ROW_KEY}
    return tuple(
        alpha_order(value) if k == "alpha" else str(value) if k == "round_to" else value for k, value in values.items()
    )


def merge(earlier: dict[str, Any], later: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """`earlier` with `later`'s new rows added, each tagged `merged_run` (an index into `merged_runs`, which
    records that run's machine, commit, settings and command). A row `earlier` already has is not added: it
    was run again as a check, and the largest relative perplexity difference to the stored row is recorded."""
    differing = [k for k in COMPARABLE_SETTINGS if earlier["settings"].get(k) != later["settings"][k]]
    if differing:
        raise SystemExit(f"--merge: the earlier result has other settings ({', '.join(differing)}); not merged")
    stored = {row_key(row): row for row in earlier["rows"]}
    run_index = len(earlier.get("merged_runs", []))
    added, rerun_differences = [], []
    for row in later["rows"]:
        previous = stored.get(row_key(row))
        if previous is None:
            added.append({**row, "merged_run": run_index})
        else:
            rerun_differences += [abs(row["ppl"][n] / previous["ppl"][n] - 1) for n in row["ppl"]]
    record = {
        "machine": later["machine"],
        "settings": later["settings"],
        "command": argv,
        "rows_added": len(added),
        "rows_rerun": len(later["rows"]) - len(added),
        "rerun_max_relative_ppl_difference": max(rerun_differences, default=None),
    }
    rows = sorted([*earlier["rows"], *added], key=row_key)
    return {**earlier, "rows": rows, "merged_runs": [*earlier.get("merged_runs", []), record]}


def _main(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    machine = machine_info()
    settings = Settings(
        models_dir=args.models_dir,
        datasets_dir=args.datasets_dir,
        n_samples=args.n_samples,
        seq_len=args.seq_len,
        seed=args.seed,
        eval_seq_len=args.eval_seq_len,
        eval_windows=args.eval_windows,
        zero_shot_tasks=tuple(args.zero_shot),
        zero_shot_limit=args.zero_shot_limit,
    )
    runs = plan(
        args.models,
        args.ratios,
        args.solvers,
        args.allocations,
        args.alphas,
        args.modes,
        args.compensation_ratios,
        args.compensation_solvers,
        args.compensations,
        args.shape_ratios,
        args.rounding_ratios,
        args.roundings,
        {model: load_config(settings.model_path(model)).intermediate_size for model in args.models},
    )
    start = time.perf_counter()
    rows, dense = run_all(runs, settings, args.jobs, args.threads, lambda message: print(message, flush=True))
    payload = {
        "rows": rows,
        "dense": dense,
        "machine": finish_machine_info(machine),
        "settings": {
            "calibration_set": CALIBRATION_SET,
            "n_samples": settings.n_samples,
            "seq_len": settings.seq_len,
            "seed": settings.seed,
            "batch_size": BATCH_SIZE,
            "eval_sets": EVAL_SETS,
            "eval_seq_len": settings.eval_seq_len,
            "eval_windows": settings.eval_windows,
            "zero_shot_tasks": list(settings.zero_shot_tasks),
            "zero_shot_limit": settings.zero_shot_limit,
            "device": "cpu",
            "jobs": args.jobs,
            "threads_per_job": args.threads,
            "shared_seconds": {d["model"]: d["shared_seconds"] for d in dense},
            "total_seconds": time.perf_counter() - start,
        },
    }
    if args.merge:
        payload = merge(json.loads(args.merge.read_text()), payload, argv or sys.argv[1:])
    write_json(args.out / "quality.json", payload)
    (args.out / "quality.md").write_text(render_markdown(payload))
    if not all_finite(payload):
        raise SystemExit("quality bench produced a non-finite number; see quality.json")
    return payload


if __name__ == "__main__":
    main()
