"""The size of a pruned model, from the dense model's config alone: before any statistics, so that a budget can be
turned into candidates (casp_core.targets) and an impossible one refused at submit.

The shape follows the budget plan (casp_core.budget) with every layer at the job's ratio: the gradient allocation
moves heads and channels between layers, not their total. Each layer prunes round(ratio x heads) query heads
(moved by one where the quantizer's block asks for it: casp_core.rounding.aligned_heads) and takes along the
fewest key/value heads; heads are added, one layer at a time, where the layers' FFN channels within r_max cannot
hold the rest; the FFN channels make up the rest of ratio x the decoder layers' attention and MLP parameters, each
layer keeping a multiple of its rounding unit and giving at least its smallest count (a K-quant's block of 256
may make that more than the ratio asks). What the plan removes is then within half a rounding unit of this.

The files: a GGUF holds each tensor in the type llama.cpp's quantizer gives it (`llama_tensor_get_type` in
llama.cpp's src/llama-quant.cpp, with `llama-quantize`'s defaults: the output and a tied embedding in Q6_K, some
attn_v and ffn_down in Q6_K under q4_k_m and q5_k_m, a row that is not a multiple of the type's block in its
fallback type), vectors in F32, each tensor padded to 32 bytes, plus the header and the tokenizer; key/value heads
are written once per query head where pruning leaves uneven groups (casp_core.export.gguf). Safetensors hold the
checkpoint's dtype, or compressed-tensors' packing of each decoder projection (casp_core.quantization).
The estimates are checked against written files in tests/core/test_size_estimate.py.
"""

import math
from dataclasses import dataclass

from transformers import PretrainedConfig

from casp_core.config import PruneSettings
from casp_core.export.gguf_types import FLOAT_TYPES
from casp_core.rounding import aligned_heads, channel_counts, head_multiple, round_to_for

GGUF_ALIGNMENT = 32
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
    "Q4_K": (144, 256),
    "Q5_K": (176, 256),
    "Q6_K": (210, 256),
}
# The type a GGUF type gives a weight unless its mix says otherwise (llama_ftype_get_default_type).
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
# tensor_type_fallback: what a 256-block type becomes on rows that are not a multiple of 256.
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# The GGUF's header, its model keys and, per tokenizer entry, the token's text, score and type (measured on the
# fixtures: tests/core/test_size_estimate.py).
GGUF_HEADER_BYTES = 2_000
GGUF_BYTES_PER_TOKEN = 26
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
SAFETENSORS_BYTES_PER_TENSOR = 100  # its entry in the JSON header
GROUP_SIZES = (128, 64, 32)  # casp_core.quantization's w4a16 groups (that module loads torch)


@dataclass(frozen=True)
class Geometry:
    """A dense model's shapes, from its config."""

    hidden: int
    ffn_width: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: a norm of head_dim weights on q and on k in every layer
    dtype_bytes: int

    @classmethod
    def of(cls, config: PretrainedConfig, dtype: str = "auto") -> "Geometry":
        heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
        name = dtype if dtype != "auto" else str(stored).removeprefix("torch.")
        return cls(
            hidden=config.hidden_size,
            ffn_width=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=config.model_type == "qwen2" or attention_bias,
            o_bias=config.model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=config.model_type == "qwen3",
            dtype_bytes=DTYPE_BYTES.get(name, 4),
        )

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def head_params(self) -> int:
        """A query head's q rows (and bias) and o columns."""
        return self.head_dim * (2 * self.hidden + self.qkv_bias)

    @property
    def kv_head_params(self) -> int:
        return 2 * self.head_dim * (self.hidden + self.qkv_bias)

    @property
    def channel_params(self) -> int:
        """An FFN channel's gate and up rows (and biases) and down column."""
        return self.hidden + 2 * (self.hidden + self.mlp_bias)

    @property
    def layer_params(self) -> int:
        """A decoder layer's attention and MLP projections: what the ratio is measured against."""
        attention = self.heads * self.head_params + self.kv_heads * self.kv_head_params + self.o_bias * self.hidden
        return attention + self.ffn_width * self.channel_params + self.mlp_bias * self.hidden

    @property
    def other_params(self) -> int:
        """Everything the pruning leaves whole: embedding, head, norms."""
        per_layer = 2 * self.hidden + 2 * self.head_dim * self.qk_norm
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden + self.layers * per_layer


@dataclass(frozen=True)
class LayerShape:
    heads: int  # query heads kept
    kv_heads: int  # key/value heads kept
    gguf_kv_heads: int  # key/value heads as the GGUF writes them (repeated where groups are uneven)
    ffn_width: int  # FFN channels kept


@dataclass(frozen=True)
class PlannedShape:
    layers: tuple[LayerShape, ...]
    params: int  # every parameter the pruned model holds
    reachable: bool  # whether whole heads and channels within r_max can remove ratio x the decoder's parameters


def _kept_groups(geometry: Geometry, pruned_heads: int) -> list[int]:
    """Query heads left per key/value group when `pruned_heads` go one from each group in turn (the plan's count
    of the fewest key/value heads emptied)."""
    rounds, extra = divmod(pruned_heads, geometry.kv_heads)
    sizes = [geometry.group - rounds - (group < extra) for group in range(geometry.kv_heads)]
    return [size for size in sizes if size > 0]


def _attention_removed(geometry: Geometry, pruned_heads: int) -> int:
    emptied = geometry.kv_heads - len(_kept_groups(geometry, pruned_heads))
    return pruned_heads * geometry.head_params + emptied * geometry.kv_head_params


def planned_shape(geometry: Geometry, settings: PruneSettings, ratio: float, block: int | None) -> PlannedShape:
    """The pruned model at `ratio` (0: the dense one), its FFN widths rounded for the quantizer's `block`."""
    if ratio <= 0:
        dense = LayerShape(geometry.heads, geometry.kv_heads, geometry.kv_heads, geometry.ffn_width)
        return PlannedShape(
            (dense,) * geometry.layers, geometry.other_params + geometry.layers * geometry.layer_params, True
        )
    n = geometry.heads
    cap = int(settings.r_max * n + 1e-9)
    multiple = head_multiple(block, geometry.head_dim)
    first = aligned_heads(ratio * n, min(round(ratio * n), cap), n, multiple, cap)
    pruned_heads = [first] * geometry.layers
    counts = channel_counts(geometry.ffn_width, settings.r_max, settings.round_to, block)
    target = ratio * geometry.layers * geometry.layer_params

    def most() -> int:
        return sum(_attention_removed(geometry, h) + counts[-1] * geometry.channel_params for h in pruned_heads)

    while most() < target and any(h < cap for h in pruned_heads):
        index = min((i for i, h in enumerate(pruned_heads) if h < cap), key=lambda i: pruned_heads[i])
        more = aligned_heads(pruned_heads[index] + 2, pruned_heads[index] + 1, n, multiple, cap)
        pruned_heads[index] = more if more > pruned_heads[index] else pruned_heads[index] + 1
    attention = sum(_attention_removed(geometry, h) for h in pruned_heads)
    channels = (target - attention) / geometry.channel_params
    unit = round_to_for(geometry.ffn_width, settings.round_to, block)
    # Each layer its share of the channels left, in its counts; the later layers make up what rounding left.
    widths = []
    for index in range(geometry.layers):
        share = channels / (geometry.layers - index)
        count = min(counts, key=lambda c: (abs(c - share), c))
        channels -= count
        widths.append(geometry.ffn_width - count)
    layers = []
    for heads, width in zip(pruned_heads, widths, strict=True):
        groups = _kept_groups(geometry, heads)
        repeat = math.gcd(*groups) if groups else 1
        layers.append(LayerShape(n - heads, len(groups), sum(size // repeat for size in groups), width))
    removed = attention + sum(geometry.ffn_width - w for w in widths) * geometry.channel_params
    dense_params = geometry.other_params + geometry.layers * geometry.layer_params
    bias = settings.compensation == "bias"  # FLAP's bias on o_proj and down_proj, where the model had none
    added = geometry.layers * geometry.hidden * ((bias and not geometry.o_bias) + (bias and not geometry.mlp_bias))
    reachable = most() >= target - unit * geometry.channel_params / 2
    return PlannedShape(tuple(layers), dense_params - removed + added, reachable)


@dataclass(frozen=True)
class Tensor:
    name: str  # as the GGUF names it
    rows: int  # ne[1]: output features (1 for a vector)
    row_length: int  # ne[0]: input features, what a block packs


def gguf_tensors(geometry: Geometry, shape: PlannedShape) -> list[Tensor]:
    """The tensors of the GGUF file of `shape`, in casp_core.export.gguf's order."""
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


def _use_more_bits(index: int, count: int) -> bool:
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def _with_fallback(ggml_type: str, row_length: int) -> str:
    """tensor_type_fallback: a type whose block the row is not a multiple of becomes a 32-block one, or F16."""
    if row_length % GGML_BLOCKS[ggml_type][1] == 0:
        return ggml_type
    fallback = FALLBACK.get(ggml_type, ggml_type)
    return fallback if row_length % GGML_BLOCKS[fallback][1] == 0 else "F16"


def tensor_types(tensors: list[Tensor], gguf_type: str, layers: int) -> list[str]:
    """The GGML type of each tensor, as llama.cpp's quantizer (with llama-quantize's defaults) chooses it."""
    base = BASE_TYPE[gguf_type]
    if gguf_type in FLOAT_TYPES:
        return [base if tensor.rows > 1 else "F32" for tensor in tensors]
    tied = not any(tensor.name == "output.weight" for tensor in tensors)
    value_count = sum(tensor.name.endswith("attn_v.weight") for tensor in tensors)
    first = next(tensor for tensor in tensors if tensor.name.endswith("attn_q.weight"))
    first_kv = next(tensor for tensor in tensors if tensor.name.endswith("attn_k.weight"))
    grouped = first.rows // first_kv.rows  # n_gqa of layer 0
    values = downs = 0
    types = []
    for tensor in tensors:
        chosen = base
        if tensor.rows == 1 or tensor.name.endswith("_norm.weight"):
            types.append("F32")
            continue
        if tensor.name == "output.weight" or (tied and tensor.name == "token_embd.weight"):
            if tensor.row_length % GGML_BLOCKS[base][1]:
                chosen = "Q8_0"
            elif base != "Q8_0":
                chosen = "Q6_K"
        elif tensor.name.endswith("attn_v.weight"):
            if gguf_type in ("q4_k_m", "q5_k_m") and _use_more_bits(values, value_count):
                chosen = "Q6_K"
            elif (gguf_type == "q4_k_s" and values < 4) or (gguf_type == "iq4_nl" and grouped >= 4):
                chosen = "Q5_K"
            values += 1
        elif tensor.name.endswith("ffn_down.weight"):
            if gguf_type in ("q4_k_m", "q5_k_m") and _use_more_bits(downs, layers):
                chosen = "Q6_K"
            elif gguf_type in ("q4_k_s", "iq4_nl") and downs < layers // 8:
                chosen = "Q5_K"
            downs += 1
        types.append(_with_fallback(chosen, tensor.row_length))
    return types


def _padded(size: int) -> int:
    return -(-size // GGUF_ALIGNMENT) * GGUF_ALIGNMENT


def gguf_bytes(geometry: Geometry, shape: PlannedShape, gguf_type: str) -> int:
    """The GGUF file of `shape` in `gguf_type`."""
    tensors = gguf_tensors(geometry, shape)
    data = 0
    for tensor, ggml_type in zip(tensors, tensor_types(tensors, gguf_type, geometry.layers), strict=True):
        block_bytes, block = GGML_BLOCKS[ggml_type]
        data += _padded(tensor.rows * -(-tensor.row_length // block) * block_bytes)
    # Each tensor's entry: its name, dimensions, type and offset.
    entries = sum(8 + len(tensor.name) + 4 + 2 * 8 + 4 + 8 for tensor in tensors)
    header = GGUF_HEADER_BYTES + geometry.vocab * GGUF_BYTES_PER_TOKEN + entries
    return _padded(header) + data


def safetensors_bytes(geometry: Geometry, shape: PlannedShape, scheme: str) -> int:
    """The checkpoint's weight files: the model's dtype, or compressed-tensors' `scheme` on each projection."""
    h, d, size = geometry.hidden, geometry.head_dim, geometry.dtype_bytes
    data = geometry.other_params * size
    tensors = 3 + 2 * geometry.layers
    for layer in shape.layers:
        projections = [
            (layer.heads * d, h),
            (layer.kv_heads * d, h),
            (layer.kv_heads * d, h),
            (h, layer.heads * d),
            (layer.ffn_width, h),
            (layer.ffn_width, h),
            (h, layer.ffn_width),
        ]
        for rows, row_length in projections:
            data += _projection_bytes(rows, row_length, scheme, size)
        biases = (
            geometry.qkv_bias * (layer.heads + 2 * layer.kv_heads) * d + geometry.o_bias * h
        ) + geometry.mlp_bias * (2 * layer.ffn_width + h)
        data += biases * size
        tensors += 7 * (2 if scheme != "none" else 1)
    return data + tensors * SAFETENSORS_BYTES_PER_TENSOR


def _projection_bytes(rows: int, row_length: int, scheme: str, size: int) -> int:
    if rows == 0 or row_length == 0:
        return 0
    if scheme == "none":
        return rows * row_length * size
    if scheme == "w4a16":
        group = next((group for group in GROUP_SIZES if row_length % group == 0), GROUP_SIZES[-1])
        return rows * row_length // 2 + rows * (row_length // group) * size
    return rows * row_length + rows * size  # int8 or fp8, one scale per output channel
