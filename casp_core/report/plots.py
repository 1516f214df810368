"""PNG plots of a pruning report's per-layer figures.

Reads `report["layers"]`, one entry per decoder layer: `{"index", "ratio", "sensitivity",
"attn": {"objective", "diagonal_objective", "offdiag_ratio"}, "mlp": {...}}`.
A figure that a layer lacks (None, or a missing sub-layer) is left out of the plot, not drawn as zero.
Figures are drawn with matplotlib's object API on the Agg canvas: no pyplot state, no display, safe in a
worker process.
"""

import math
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

SUBLAYERS = {"attn": "attention (heads)", "mlp": "MLP (channels)"}


def _value(entry: dict[str, Any], *keys: str) -> float:
    """entry[k0][k1]..., as a float; NaN where absent (matplotlib leaves NaN points out)."""
    value: Any = entry
    for key in keys:
        if not isinstance(value, dict) or value.get(key) is None:
            return math.nan
        value = value[key]
    return float(value)


def _positive(values: list[float]) -> list[float]:
    """A log axis cannot show values <= 0: those are left out."""
    return [v if v > 0 else math.nan for v in values]


def _save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=120)
    return path


def _layer_axis(axes: Axes, indices: list[int]) -> None:
    """Whole layer numbers, every layer in view even where its figure is absent."""
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlim(min(indices) - 0.6, max(indices) + 0.6)
    axes.set_xlabel("decoder layer")
    axes.grid(True, alpha=0.3)


def _per_layer_axes(title: str, ylabel: str, indices: list[int]) -> tuple[Figure, Axes]:
    figure = Figure(figsize=(7, 4))
    axes = figure.add_subplot()
    axes.set_title(title)
    axes.set_ylabel(ylabel)
    _layer_axis(axes, indices)
    return figure, axes


def plot_ratios(layers: list[dict[str, Any]], path: Path) -> Path:
    indices = [layer["index"] for layer in layers]
    figure, axes = _per_layer_axes("Per-layer pruning ratio", "r_l", indices)
    ratios = [_value(layer, "ratio") for layer in layers]
    axes.bar(indices, ratios, color="tab:blue")
    mean = math.fsum(r for r in ratios if not math.isnan(r)) / max(1, sum(not math.isnan(r) for r in ratios))
    axes.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {mean:.3f}")
    axes.legend()
    return _save(figure, path)


def plot_sensitivity(layers: list[dict[str, Any]], path: Path) -> Path:
    indices = [layer["index"] for layer in layers]
    figure, axes = _per_layer_axes("Layer sensitivity", "S_l = mean ||dJ/dZ_l||² (log scale)", indices)
    axes.plot(indices, _positive([_value(layer, "sensitivity") for layer in layers]), marker="o")
    axes.set_yscale("log")
    return _save(figure, path)


def plot_offdiag_ratio(layers: list[dict[str, Any]], path: Path) -> Path:
    indices = [layer["index"] for layer in layers]
    figure, axes = _per_layer_axes("Off-diagonal energy ratio of Q", "rho", indices)
    for sub, label in SUBLAYERS.items():
        axes.plot(indices, [_value(layer, sub, "offdiag_ratio") for layer in layers], marker="o", label=label)
    axes.legend()
    return _save(figure, path)


def plot_objectives(layers: list[dict[str, Any]], path: Path, solver_name: str) -> Path:
    """The solver's cost z'Qz against the independent (diagonal) choice's, per layer and sub-layer."""
    figure = Figure(figsize=(11, 4))
    indices = [layer["index"] for layer in layers]
    width = 0.4
    for column, (sub, label) in enumerate(SUBLAYERS.items(), start=1):
        axes = figure.add_subplot(1, 2, column)
        axes.set_title(f"Pruning cost z'Qz: {label}")
        axes.set_ylabel("cost (log scale)")
        _layer_axis(axes, indices)
        solver = _positive([_value(layer, sub, "objective") for layer in layers])
        diagonal = _positive([_value(layer, sub, "diagonal_objective") for layer in layers])
        axes.bar([i - width / 2 for i in indices], solver, width, label=f"{solver_name} (solver)")
        axes.bar([i + width / 2 for i in indices], diagonal, width, label="diagonal (independent)")
        if any(not math.isnan(v) for v in solver + diagonal):
            axes.set_yscale("log")
        axes.legend(loc="best", fontsize="small")
    return _save(figure, path)


RECOVERY_CURVE = "plots/recovery_loss.png"


def plot_recovery_curve(curve: list[dict[str, float]], path: Path) -> Path:
    """The recovery stage's training loss per optimizer step (`report["recovery"]["curve"]`); with distillation,
    its two terms too (the cross-entropy and the KL divergence from the teacher)."""
    figure = Figure(figsize=(7, 4))
    axes = figure.add_subplot()
    axes.set_title("Recovery: training loss")
    steps = [point["step"] for point in curve]
    marker = "." if len(curve) < 50 else ""
    terms = {"loss": "loss trained on", "ce": "cross-entropy", "kl": "KL from the teacher"}
    shown = [name for name in terms if curve and name in curve[0]]
    for name in shown if "kl" in shown else ["loss"]:
        axes.plot(steps, [point[name] for point in curve], marker=marker, label=terms[name])
    if "kl" in shown:
        axes.legend(loc="best", fontsize="small")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("mean next-token loss (nats)")
    axes.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(figure, path)


FRONTIER_PLOT = "frontier.png"


def point_name(point: dict[str, Any]) -> str:
    """A frontier point as the plot and the report name it: `the dense model` or `ratio 0.3`."""
    return "the dense model" if point["dense"] else f"ratio {point['ratio']:g}"


def plot_frontier(frontier: dict[str, Any], path: Path) -> Path:
    """A sweep's candidates (`report["frontier"]`, casp_core.job.sweep.run): perplexity on the first text against the
    file size, one line per ratio across its variants (the dense points as ratio 0), the Pareto front and the pick
    marked, and the budget: a bytes budget as a vertical line, a perplexity increase as a horizontal one (a
    parameters budget has no place on this axis; its candidates' `within_target` says which met it)."""
    figure = Figure(figsize=(8, 5))
    axes = figure.add_subplot()
    text = frontier["perplexity_text"]
    axes.set_title(f"Perplexity against size ({frontier['format']})")
    axes.set_xlabel("bytes (MB)")
    axes.set_ylabel(f"perplexity, {text}")
    axes.grid(True, alpha=0.3)
    points = frontier["candidates"]
    for ratio in sorted({point["ratio"] for point in points}):
        line = sorted((point for point in points if point["ratio"] == ratio), key=lambda point: point["bytes"])
        sizes = [point["bytes"] / 1e6 for point in line]
        perplexities = [_value(point, "perplexity", text) for point in line]
        axes.plot(sizes, perplexities, marker="o", label="dense" if ratio == 0 else f"ratio {ratio:g}")
        for point, size, perplexity in zip(line, sizes, perplexities, strict=True):
            axes.annotate(point["variant"], (size, perplexity), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = sorted((point for point in points if point["on_front"]), key=lambda point: point["bytes"])
    axes.plot(
        [point["bytes"] / 1e6 for point in front],
        [_value(point, "perplexity", text) for point in front],
        color="black", linestyle=":", marker="s", markerfacecolor="none", markersize=10, label="Pareto front",
    )  # fmt: skip
    pick = frontier["pick"]
    axes.plot(
        [pick["bytes"] / 1e6], [_value(pick, "perplexity", text)], marker="*", color="gold", markersize=18,
        markeredgecolor="black", linestyle="none", label=f"pick: {point_name(pick)}, {pick['variant']}",
    )  # fmt: skip
    target = frontier["target"]
    if target.get("max_bytes") is not None:
        axes.axvline(target["max_bytes"] / 1e6, color="tab:red", linestyle="--", label="budget")
    elif target.get("max_perplexity_increase") is not None:
        limit = frontier["dense_perplexity"][text] * (1 + target["max_perplexity_increase"])
        highest = max(
            (v for v in (_value(point, "perplexity", text) for point in points) if not math.isnan(v)), default=0
        )
        if limit <= 1.5 * highest:
            axes.axhline(limit, color="tab:red", linestyle="--", label="allowed perplexity")
        else:  # drawn, it would squeeze every point against the axis
            axes.set_title(f"Perplexity against size ({frontier['format']}); allowed: up to {limit:.4g}")
    axes.legend(fontsize="small")
    return _save(figure, path)


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Writes the plots into `out_dir/plots/` (a sweep's frontier plot: `out_dir/frontier.png`) and returns their
    paths."""
    layers = sorted(report["layers"], key=lambda layer: layer["index"])
    plots_dir = Path(out_dir) / "plots"
    solver_name = report.get("settings", {}).get("solver", "greedy")
    plots = []
    if layers:  # none for a sweep's dense pick, which nothing pruned
        plots_dir.mkdir(parents=True, exist_ok=True)
        plots += [
            plot_ratios(layers, plots_dir / "layer_ratio.png"),
            plot_sensitivity(layers, plots_dir / "layer_sensitivity.png"),
            plot_offdiag_ratio(layers, plots_dir / "offdiag_ratio.png"),
            plot_objectives(layers, plots_dir / "objective_solver_vs_diagonal.png", solver_name),
        ]
    if report.get("recovery", {}).get("curve"):
        plots.append(plot_recovery_curve(report["recovery"]["curve"], Path(out_dir) / RECOVERY_CURVE))
    if report.get("frontier"):
        plots.append(plot_frontier(report["frontier"], Path(out_dir) / FRONTIER_PLOT))
    return plots
