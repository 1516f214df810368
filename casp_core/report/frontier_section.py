"""A sweep's candidates, for report.md and the model card: the target, the pick and the table of every point
measured (`report["frontier"]`, casp_core.sweep), with the frontier plot."""

from typing import Any

from casp_core.report.plots import FRONTIER_PLOT


def target_line(target: dict[str, Any], dense_perplexity: float) -> str:
    """The target in words, and the rule the pick follows."""
    if target.get("max_bytes") is not None:
        return (
            f"at most {target['max_bytes']:,} bytes of {target['format']}: the lowest perplexity among the "
            "candidates within it"
        )
    if target.get("max_params") is not None:
        return f"at most {target['max_params']:,} parameters: the lowest perplexity among the candidates within it"
    increase = target["max_perplexity_increase"]
    return (
        f"perplexity at most {increase:g} above the dense model's {dense_perplexity:.4g} (up to "
        f"{dense_perplexity * (1 + increase):.4g}): the smallest file within it"
    )


def _yes(value: bool) -> str:
    return "yes" if value else ""


def render_frontier_section(frontier: dict[str, Any] | None) -> list[str]:
    """Markdown lines; none for a single-ratio job."""
    if not frontier:
        return []
    text = frontier["perplexity_text"]
    pick = frontier["pick"]
    lines = [
        "## Sweep: the candidates and the pick",
        "",
        f"- target: {target_line(frontier['target'], frontier['dense_perplexity'][text])}",
        f"- the pick: ratio {pick['ratio']:g} in {pick['variant']}, {pick['bytes']:,} bytes, "
        f"{pick['params']:,} parameters, perplexity {pick['perplexity'][text]:.4g} on {text}: this folder's model",
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
