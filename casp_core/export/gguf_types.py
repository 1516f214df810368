"""The GGUF weight types casp writes and the block each packs rows in: light (no torch, no gguf, no llama.cpp),
so that the settings, the budget and the API can check a request before any work.

f32, f16 and bf16 are written by the `gguf` package. The quantized types are made by llama.cpp's own quantizer
(llama-cpp-python, the optional extra `casp[gguf]`) from an f32 GGUF: the K-quants pack a row in super-blocks of
256 weights, q8_0, q4_0, q5_0 and iq4_nl in blocks of 32. A weight whose rows (its input width) are not a multiple
of the block gets another type from llama.cpp (`tensor_type_fallback` in llama.cpp's src/llama-quant.cpp).
"""

from typing import Any

from casp_core.config import PruneSettings
from casp_core.errors import CaspError, InvalidConfig

FLOAT_TYPES = ("f32", "f16", "bf16")
SUPER_BLOCK = 256  # QK_K
BLOCK = 32  # QK8_0, QK4_0, QK5_0, QK4_NL
K_QUANTS = ("q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s")
BLOCK_32_TYPES = ("q8_0", "q4_0", "q5_0", "iq4_nl")
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
}
# llama.cpp's tensor_type_fallback (src/llama-quant.cpp): the 32-block type a 256-block type becomes on rows that
# are not a multiple of 256.
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL", "Q3_K": "Q4_0"}
LLAMA_CPP_MISSING = "llama-cpp-python is not installed: pip install 'casp[gguf]'"


class LlamaCppMissing(CaspError):
    """A quantized GGUF asked for on a machine without llama-cpp-python (the `gguf` extra)."""

    code = "llama_cpp_missing"


def is_quantized(gguf_type: str) -> bool:
    return gguf_type not in FLOAT_TYPES


def block_of(gguf_type: str) -> int | None:
    """The row multiple llama.cpp's quantizer needs for `gguf_type`'s own weights; None for the float types."""
    if gguf_type in K_QUANTS:
        return SUPER_BLOCK
    return BLOCK if gguf_type in BLOCK_32_TYPES else None


def quantizer_block(settings: PruneSettings) -> int | None:
    """The block a job's widths should fit: that of its GGUF type when it exports a quantized GGUF, else None."""
    return block_of(settings.gguf_type) if "gguf" in settings.export else None


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


def check_gguf_type(hidden_size: int, gguf_type: str) -> None:
    """Refuse a type whose block the model's hidden size (the rows of every q/k/v, gate/up and embedding weight)
    is not a multiple of: nearly every weight would fall back. Names the closest type that fits."""
    block = block_of(gguf_type)
    if block is None or hidden_size % block == 0:
        return
    instead = f"use {' / '.join(BLOCK_32_TYPES)}, whose block is {BLOCK}" if hidden_size % BLOCK == 0 else "use f16"
    raise InvalidConfig(
        f"gguf_type: {gguf_type} packs rows in blocks of {block}, and this model's hidden size {hidden_size} is not "
        f"a multiple of {block} ({instead})"
    )
