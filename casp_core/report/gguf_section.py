"""The GGUF files a job wrote, for report.md and the model card: each file's tensor types, size and bits per
weight, and every weight that got a fallback type instead of its quantized type's (`GgufExport.summary()`)."""

from typing import Any


def _fallback_line(fallback: dict[str, Any]) -> str:
    instead = f"instead of {fallback['wanted']}" if fallback["wanted"] else "(no quantized type fits)"
    return (
        f"- `{fallback['tensor']}`: {fallback['type']} {instead}, its rows of {fallback['row_length']} weights "
        "not being a multiple of the block"
    )


def render_gguf_section(exports: list[dict[str, Any]]) -> list[str]:
    """Markdown lines; none without a GGUF export."""
    if not exports:
        return []
    lines = [
        "## GGUF files",
        "",
        "| file | type | bytes | bits per weight | tensor types (count) | fallbacks |",
        "|---|---|---|---|---|---|",
    ]
    for export in exports:
        types = ", ".join(f"{name} {count}" for name, count in export["tensor_types"].items())
        lines.append(
            f"| {export['path']} | {export['gguf_type']} | {export['bytes']:,} | {export['bits_per_weight']:.2f} | "
            f"{types} | {len(export['fallbacks'])} |"
        )
    for export in exports:
        if export["fallbacks"]:
            lines += ["", f"Fallbacks in {export['path']} (llama.cpp's quantizer, for rows its block does not fit):"]
            lines += ["", *map(_fallback_line, export["fallbacks"])]
    return [*lines, ""]
