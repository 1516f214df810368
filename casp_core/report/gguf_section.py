"""The GGUF files a job wrote, for report.md and the model card: each file's tensor types, size and bits per
weight (llama.cpp's BPW), and the weights that got a fallback type instead of the one llama.cpp's mix gives them
(`GgufExport.summary()`), grouped by fallback and row length: a model whose hidden size is no multiple of 256 has
one such group for nearly every weight of every layer under a K-quant."""

import re
from typing import Any

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)\.weight")


def _layer_ranges(layers: list[int]) -> str:
    """`0-3, 7, 9-10`."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


def _where(tensors: list[str]) -> str:
    """The tensors by kind, the kinds found in the same layers together: `attn_q`, `ffn_up` in layers 0-29."""
    layers_of: dict[str, list[int]] = {}
    outside: list[str] = []
    for tensor in tensors:
        if match := _LAYER_TENSOR.fullmatch(tensor):
            layers_of.setdefault(match[2], []).append(int(match[1]))
        else:
            outside.append(f"`{tensor.removesuffix('.weight')}`")
    kinds_of: dict[tuple[int, ...], list[str]] = {}
    for kind, layers in layers_of.items():
        kinds_of.setdefault(tuple(layers), []).append(f"`{kind}`")
    parts = [
        f"{', '.join(kinds)} in layer{'s' if len(layers) > 1 else ''} {_layer_ranges(list(layers))}"
        for layers, kinds in kinds_of.items()
    ]
    return "; ".join([*outside, *parts])


def _fallback_lines(fallbacks: list[dict[str, Any]]) -> list[str]:
    groups: dict[tuple[str, str, int, int], list[str]] = {}
    for fallback in fallbacks:
        key = (fallback["type"], fallback["wanted"], fallback["row_length"], fallback["block"])
        groups.setdefault(key, []).append(fallback["tensor"])
    lines = []
    for (got, wanted, row_length, block), tensors in groups.items():
        count = f"{len(tensors)} tensor{'s' if len(tensors) > 1 else ''}"
        nor = " (nor of 32, so no quantized fallback fits)" if got == "F16" and block != 32 else ""
        lines.append(
            f"- {got} instead of {wanted}: {count} whose rows of {row_length} weights are not whole blocks of "
            f"{block}{nor}: {_where(tensors)}"
        )
    return lines


def render_gguf_section(exports: list[dict[str, Any]]) -> list[str]:
    """Markdown lines; none without a GGUF export."""
    if not exports:
        return []
    lines = [
        "## GGUF files",
        "",
        "| file | type | bytes | bits per weight (llama.cpp's BPW) | tensor types (count) | fallbacks |",
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
            lines += [
                "",
                f"Fallbacks in {export['path']}: llama.cpp's quantizer gives a weight whose rows are not whole blocks "
                f"of its type another type, as in llama.cpp's own {export['gguf_type']} of a model of this shape:",
            ]
            lines += ["", *_fallback_lines(export["fallbacks"])]
    return [*lines, ""]
