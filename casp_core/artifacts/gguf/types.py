"""The GGUF weight types casp writes, the block each packs rows in, and the type llama.cpp's quantizer gives each
tensor: light (no torch, no gguf, no llama.cpp), so that the settings, the budget, the size estimate and the API
can reason about a request before any work.

f32, f16 and bf16 are written by the `gguf` package. The quantized types are made by llama.cpp's own quantizer
(llama-cpp-python, the optional extra `casp[gguf]`) from an f32 GGUF: the K-quants pack a row in super-blocks of
256 weights, q8_0, q4_0, q5_0 and iq4_nl in blocks of 32. Any hidden size is taken, as llama.cpp takes it: a
weight whose rows (its input width) are not a multiple of its type's block gets another type
(`tensor_type_fallback` in llama.cpp's src/llama-quant.cpp), which is what the Q4_K_M files of models such as
SmolLM2 (hidden 576) hold. `llama_cpp_types` says which type each tensor gets, before and after that fallback.
"""

from dataclasses import dataclass
from typing import Any

from casp_core.errors import CaspError

FLOAT_TYPES = ("f32", "f16", "bf16")
# The ggml type each GGUF type gives a weight by default (llama_ftype_get_default_type); llama.cpp's mix gives
# some others (Q6_K to the output, ...).
BASE_TYPE = {
    "f32": "F32",
    "f16": "F16",
    "bf16": "BF16",
    "q8_0": "Q8_0",
    "q6_k": "Q6_K",
    "q5_k_m": "Q5_K",
    "q5_k_s": "Q5_K",
    "q4_k_m": "Q4_K",
    "q4_k_s": "Q4_K",
    "q4_0": "Q4_0",
    "q5_0": "Q5_0",
    "iq4_nl": "IQ4_NL",
    "q3_k_m": "Q3_K",
    "q2_k": "Q2_K",
}
# llama.cpp's tensor_type_fallback (src/llama-quant.cpp): the 32-block type a 256-block type becomes on rows that
# are not a multiple of 256. A type without one here (or whose fallback does not fit either) becomes F16.
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# Bytes of one block and the weights it holds, as ggml stores each type.
GGML_BLOCKS = {
    "F32": (4, 1),
    "F16": (2, 1),
    "BF16": (2, 1),
    "Q8_0": (34, 32),
    "Q4_0": (18, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "IQ4_NL": (18, 32),
    "Q2_K": (84, 256),
    "Q3_K": (110, 256),
    "Q4_K": (144, 256),
    "Q5_K": (176, 256),
    "Q6_K": (210, 256),
}
LLAMA_CPP_MISSING = "llama-cpp-python is not installed: pip install 'casp[gguf]'"


class LlamaCppMissing(CaspError):
    """A quantized GGUF asked for on a machine without llama-cpp-python (the `gguf` extra)."""

    code = "llama_cpp_missing"


def is_quantized(gguf_type: str) -> bool:
    return gguf_type not in FLOAT_TYPES


def llama_cpp_module() -> Any | None:
    """llama_cpp, or None where it is not installed (imported only where needed: it loads a native library)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def require_llama_cpp() -> None:
    """Refuse, before any work, a quantized GGUF on a machine without llama-cpp-python."""
    if llama_cpp_module() is None:
        raise LlamaCppMissing(LLAMA_CPP_MISSING)


@dataclass(frozen=True)
class Tensor:
    """A tensor of a GGUF file, as llama.cpp's quantizer sees it."""

    name: str  # as the GGUF names it
    rows: int  # ne[1]: output features (1 for a vector)
    row_length: int  # ne[0]: input features, what a block packs


@dataclass(frozen=True)
class TypeChoice:
    """The GGML type llama.cpp's quantizer gives one tensor."""

    mix: str  # what the GGUF type's mix gives it (llama_tensor_get_type), were its rows whole blocks of that type
    type: str  # what it gets: `mix`, or the fallback for rows that are not whole blocks of `mix`


def _use_more_bits(index: int, count: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in the _M mixes."""
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def with_fallback(ggml_type: str, row_length: int) -> str:
    """tensor_type_fallback: a type whose block the row is not a multiple of becomes its 32-block fallback, or F16
    where there is none that fits."""
    if row_length % GGML_BLOCKS[ggml_type][1] == 0:
        return ggml_type
    fallback = FALLBACK.get(ggml_type, ggml_type)
    return fallback if row_length % GGML_BLOCKS[fallback][1] == 0 else "F16"


def _value_mix(gguf_type: str, base: str, index: int, count: int, grouped: int) -> str:
    """attn_v of the `index`-th of `count` layers with attention; `grouped` query heads per key/value head."""
    if gguf_type == "q2_k":
        return "Q4_K" if grouped >= 4 else "Q3_K"
    if gguf_type == "q3_k_m":
        return "Q5_K" if index < 2 else "Q4_K"
    if gguf_type in ("q4_k_m", "q5_k_m") and _use_more_bits(index, count):
        return "Q6_K"
    if (gguf_type == "q4_k_s" and index < 4) or (gguf_type == "iq4_nl" and grouped >= 4):
        return "Q5_K"
    return base


def _down_mix(gguf_type: str, base: str, index: int, layers: int) -> str:
    """ffn_down of layer `index` of `layers` (llama.cpp's rules for the llama and deci architectures)."""
    if gguf_type == "q2_k":
        return "Q3_K"
    if gguf_type == "q3_k_m":
        return "Q5_K" if index < layers // 16 else "Q4_K"
    if gguf_type in ("q4_k_m", "q5_k_m") and _use_more_bits(index, layers):
        return "Q6_K"
    if gguf_type in ("q4_k_s", "iq4_nl") and index < layers // 8:
        return "Q5_K"
    return base


def llama_cpp_types(tensors: list[Tensor], gguf_type: str) -> list[TypeChoice]:
    """The type of each tensor of a GGUF file (in the file's layer order) in `gguf_type`: for the quantized types,
    as llama.cpp's quantizer chooses it with llama-quantize's defaults (llama_tensor_get_type, then
    tensor_type_fallback): the output and a tied embedding in Q6_K (Q8_0 in q8_0), more bits for some attn_v and
    ffn_down layers, q2_k's and q3_k_m's attn_output in Q3_K and Q4_K, vectors and norms left in F32. Not
    modelled: the rules for architectures casp does not write (Falcon, mixtures of experts) and for 70B models."""
    base = BASE_TYPE[gguf_type]
    if gguf_type in FLOAT_TYPES:
        return [TypeChoice(chosen, chosen) for chosen in (base if t.rows > 1 else "F32" for t in tensors)]
    tied = not any(tensor.name == "output.weight" for tensor in tensors)
    value_count = sum(tensor.name.endswith("attn_v.weight") for tensor in tensors)
    layers = sum(tensor.name.endswith("ffn_down.weight") for tensor in tensors)
    first_query = next(tensor for tensor in tensors if tensor.name.endswith("attn_q.weight"))
    first_key = next(tensor for tensor in tensors if tensor.name.endswith("attn_k.weight"))
    grouped = first_query.rows // first_key.rows  # n_gqa of layer 0
    values = downs = 0
    choices = []
    for tensor in tensors:
        if tensor.rows == 1 or tensor.name.endswith("_norm.weight"):  # llama.cpp quantizes matrices only
            choices.append(TypeChoice("F32", "F32"))
            continue
        mix = base
        if tensor.name == "output.weight" or (tied and tensor.name == "token_embd.weight"):
            mix = base if base == "Q8_0" else "Q6_K"  # llama.cpp's own Q8_0 for rows of no whole block is the fallback
        elif tensor.name.endswith("attn_v.weight"):
            mix = _value_mix(gguf_type, base, values, value_count, grouped)
            values += 1
        elif tensor.name.endswith("ffn_down.weight"):
            mix = _down_mix(gguf_type, base, downs, layers)
            downs += 1
        elif tensor.name.endswith("attn_output.weight"):
            mix = {"q2_k": "Q3_K", "q3_k_m": "Q4_K"}.get(gguf_type, base)
        choices.append(TypeChoice(mix, with_fallback(mix, tensor.row_length)))
    return choices
