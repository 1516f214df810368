"""The bytes of a GGUF file of a planned shape, before it is written: each tensor in the type llama.cpp's quantizer
gives it (casp_core.artifacts.gguf.types' `llama_cpp_types`: llama.cpp's mix with `llama-quantize`'s defaults, and a
row that is not a multiple of the type's block in its fallback type, as every q/k/v, gate/up and embedding row of a
model whose hidden size is no multiple of 256 under a K-quant), vectors in F32, each tensor padded to 32 bytes, plus
the header and the tokenizer; key/value heads are written once per query head where pruning leaves uneven groups
(casp_core.artifacts.gguf.writer). tests/core/job/sweep/test_size_estimate.py checks it against written files."""

from casp_core.artifacts.gguf.types import GGML_BLOCKS, Tensor, llama_cpp_types
from casp_core.artifacts.shapes import Geometry, PlannedShape

GGUF_ALIGNMENT = 32
# The GGUF's header, its model keys and, per tokenizer entry, the token's text, score and type (measured on the
# fixtures: tests/core/job/sweep/test_size_estimate.py).
GGUF_HEADER_BYTES = 1_500
GGUF_BYTES_PER_TOKEN = 23


def gguf_tensors(geometry: Geometry, shape: PlannedShape) -> list[Tensor]:
    """The tensors of the GGUF file of `shape`, in casp_core.artifacts.gguf.writer's order."""
    h, d = geometry.hidden, geometry.head_dim
    tensors = [Tensor("token_embd.weight", geometry.vocab, h)]
    for index, layer in enumerate(shape.layers):
        heads, kv = layer.heads, layer.gguf_kv_heads
        if index == 0 and heads == 0:
            heads = kv = 1  # a head of zeros: llama.cpp reads every layer's head size from layer 0
        prefix = f"blk.{index}"
        if heads:
            tensors.append(Tensor(f"{prefix}.attn_norm.weight", 1, h))
            tensors += [
                Tensor(f"{prefix}.attn_{p}.weight", rows * d, h) for p, rows in (("q", heads), ("k", kv), ("v", kv))
            ]
            if geometry.qkv_bias:
                tensors += [
                    Tensor(f"{prefix}.attn_{p}.bias", 1, rows * d) for p, rows in (("q", heads), ("k", kv), ("v", kv))
                ]
            tensors.append(Tensor(f"{prefix}.attn_output.weight", h, heads * d))
            if geometry.o_bias:
                tensors.append(Tensor(f"{prefix}.attn_output.bias", 1, h))
        width = max(layer.ffn_width, 1)
        tensors.append(Tensor(f"{prefix}.ffn_norm.weight", 1, h))
        for name, rows, row_length in (("gate", width, h), ("up", width, h), ("down", h, width)):
            tensors.append(Tensor(f"{prefix}.ffn_{name}.weight", rows, row_length))
            if geometry.mlp_bias:
                tensors.append(Tensor(f"{prefix}.ffn_{name}.bias", 1, rows))
    tensors.append(Tensor("output_norm.weight", 1, h))
    if not geometry.tied:
        tensors.append(Tensor("output.weight", geometry.vocab, h))
    return tensors


def _padded(size: int) -> int:
    return -(-size // GGUF_ALIGNMENT) * GGUF_ALIGNMENT


def gguf_bytes(geometry: Geometry, shape: PlannedShape, gguf_type: str) -> int:
    """The GGUF file of `shape` in `gguf_type`."""
    tensors = gguf_tensors(geometry, shape)
    data = 0
    for tensor, choice in zip(tensors, llama_cpp_types(tensors, gguf_type), strict=True):
        block_bytes, block = GGML_BLOCKS[choice.type]
        data += _padded(tensor.rows * -(-tensor.row_length // block) * block_bytes)
    # Each tensor's entry: its name, dimensions, type and offset.
    entries = sum(8 + len(tensor.name) + 4 + 2 * 8 + 4 + 8 for tensor in tensors)
    header = GGUF_HEADER_BYTES + geometry.vocab * GGUF_BYTES_PER_TOKEN + entries
    return _padded(header) + data
