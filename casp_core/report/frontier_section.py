"""A sweep's candidates, for report.md and the model card: the target, the pick and the table of every point
measured (`report["frontier"]`, casp_core.job.sweep.run), with the frontier plot."""

from typing import Any

from casp_core.report.plots import FRONTIER_PLOT, point_name


def target_line(target: dict[str, Any], dense_perplexity: float) -> str:
    """The target in words, and the rule the pick follows (among the pruned candidates and, with `candidates`
    "all", the dense model in each variant)."""
    among = "pruned candidates" if target.get("candidates") == "pruned" else "candidates, dense ones included,"
    if target.get("max_bytes") is not None:
        return (
            f"at most {target['max_bytes']:,} bytes of {target['format']}: the lowest perplexity among the {among} "
            "within it"
        )
    if target.get("max_params") is not None:
        return f"at most {target['max_params']:,} parameters: the lowest perplexity among the {among} within it"
    increase = target["max_perplexity_increase"]
    return (
        f"perplexity at most {increase:g} above the dense model's {dense_perplexity:.4g} (up to "
        f"{dense_perplexity * (1 + increase):.4g}): the smallest file among the {among} within it"
    )


def dense_pick_reason(frontier: dict[str, Any] | None) -> str | None:
    """Why the sweep handed back the dense model (one sentence, the best pruned point beside it), or None when its
    pick is pruned (or the job is no sweep)."""
    return (frontier or {}).get("dense_pick")


def _yes(value: bool) -> str:
    return "yes" if value else ""


def render_frontier_section(frontier: dict[str, Any] | None) -> list[str]:
    """Markdown lines; none for a single-ratio job."""
    if not frontier:
        return []
    text = frontier["perplexity_text"]
    pick = frontier["pick"]
    dense_pick = dense_pick_reason(frontier)
    lines = [
        "## Sweep: the candidates and the pick",
        "",
        f"- target: {target_line(frontier['target'], frontier['dense_perplexity'][text])}",
        f"- the pick: {point_name(pick)} in {pick['variant']}, {pick['bytes']:,} bytes, {pick['params']:,} "
        f"parameters, perplexity {pick['perplexity'][text]:.4g} on {text}: this folder's model",
        *([f"- why the dense model: {dense_pick}"] if dense_pick else []),
        "- each candidate measured in its serving engine (GGUF in llama.cpp, safetensors in transformers); on the "
        "front: no other point is both smaller and lower in perplexity (frontier.json has every figure)",
        "",
        f"| ratio | {frontier['format']} | bytes | parameters | perplexity ({text}) | within target | on front "
        "| seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for point in frontier["candidates"]:
        ratio = "dense" if point["dense"] else f"{point['ratio']:g}"
        perplexity = point["perplexity"].get(text)
        lines.append(
            f"| {ratio}{' (pick)' if point == pick else ''} | {point['variant']} | {point['bytes']:,} | "
            f"{point['params']:,} | {'-' if perplexity is None else f'{perplexity:.4g}'} | "
            f"{_yes(point['within_target'])} | {_yes(point['on_front'])} | {point['seconds']:.1f} |"
        )
    return [*lines, "", f"![perplexity against size]({FRONTIER_PLOT})", ""]
