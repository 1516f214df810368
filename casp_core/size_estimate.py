"""The size of a pruned model, from the dense model's config alone: before any statistics, so that a budget can be
turned into candidates (casp_core.targets) and an impossible one refused at submit.

The shape is the budget plan's (casp_core.budget), made for a model of that config built on the meta device (no
weights): the per-layer ratios the allocation would give if the layers' sensitivities were spread evenly, from the
first layer, the most sensitive (r_l = 0, as min-max normalisation gives the most sensitive layer), to the last
(`allocation: uniform` and `shape: uniform` as they are); each layer's heads as the plan fixes them; its FFN
channels as the pruning takes them, layer by layer, from the plan; key/value heads emptied as the plan counts them
(the fewest). What a real job removes is within half a rounding unit of the same total; which layers give more
depends on the sensitivities, which the estimate cannot know.

The files: a GGUF holds each tensor in the type llama.cpp's quantizer gives it (casp_core.export.gguf_types'
`llama_cpp_types`: llama.cpp's mix with `llama-quantize`'s defaults, and a row that is not a multiple of the type's
block in its fallback type, as every q/k/v, gate/up and embedding row of a model whose hidden size is no multiple
of 256 under a K-quant), vectors in F32, each tensor padded to 32 bytes, plus the header and the tokenizer;
key/value heads are written once per query head where pruning leaves uneven groups (casp_core.export.gguf).
Safetensors hold the checkpoint's dtype, or compressed-tensors' packing of each decoder projection
(casp_core.quantization). tests/core/test_size_estimate.py checks the estimates against written files (README,
"Prune to a budget", states how close).
"""

import math
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from casp_core.allocation import allocate_ratios, uniform_ratios
from casp_core.budget import channels_to_prune, plan_budget, plan_uniform_shape
from casp_core.config import MEAN_BIAS_COMPENSATION, UNIFORM_SHAPE, PruneConfig, fixed_alpha
from casp_core.export.gguf_types import GGML_BLOCKS, Tensor, llama_cpp_types
from casp_core.families import projections
from casp_core.model import attention_geometry, decoder_layers, sublayer_parameters

GGUF_ALIGNMENT = 32
# The GGUF's header, its model keys and, per tokenizer entry, the token's text, score and type (measured on the
# fixtures: tests/core/test_size_estimate.py).
GGUF_HEADER_BYTES = 1_500
GGUF_BYTES_PER_TOKEN = 23
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
SAFETENSORS_BYTES_PER_TENSOR = 100  # its entry in the JSON header
GROUP_SIZES = (128, 64, 32)  # casp_core.quantization's w4a16 groups (that module loads torch)


@dataclass(frozen=True)
class Geometry:
    """What the files' sizes need of a dense model besides its pruned shape."""

    hidden: int
    head_dim: int
    vocab: int
    layers: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    other_params: int  # embedding, head and norms: everything the pruning leaves whole
    dtype_bytes: int

    @classmethod
    def of(cls, model: PreTrainedModel, dtype: str) -> "Geometry":
        layers = decoder_layers(model)
        parts = projections(layers[0])
        config = model.config
        stored = getattr(config, "dtype", None) or "float32"
        name = dtype if dtype != "auto" else str(stored).removeprefix("torch.")
        return cls(
            hidden=config.hidden_size,
            head_dim=attention_geometry(model, layers[0]).head_dim,
            vocab=config.vocab_size,
            layers=len(layers),
            tied=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            qkv_bias=parts.q.bias is not None,
            o_bias=parts.o.bias is not None,
            mlp_bias=parts.down.bias is not None,
            other_params=dense_params(model) - sum(sum(sublayer_parameters(layer)) for layer in layers),
            dtype_bytes=DTYPE_BYTES.get(name, 4),
        )

    def projection_params(self, shape: "LayerShape") -> int:
        """A layer's attention and MLP projections, biases included, in `shape`."""
        h, d = self.hidden, self.head_dim
        q, kv, w = shape.heads * d, shape.kv_heads * d, shape.ffn_width
        attention = (q + 2 * kv) * (h + self.qkv_bias) + h * q + self.o_bias * h
        return attention + 2 * w * (h + self.mlp_bias) + h * w + self.mlp_bias * h


@dataclass(frozen=True)
class LayerShape:
    heads: int  # query heads kept
    kv_heads: int  # key/value heads kept
    gguf_kv_heads: int  # key/value heads as the GGUF writes them (repeated where groups are uneven)
    ffn_width: int  # FFN channels kept


@dataclass(frozen=True)
class PlannedShape:
    layers: tuple[LayerShape, ...]
    params: int  # every parameter the pruned model holds (tied ones once)


def dense_params(model: PreTrainedModel) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model of `config` without weights: its modules and shapes, for the budget plan."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def estimated_ratios(n_layers: int, config: PruneConfig) -> list[float]:
    """The per-layer ratios of sensitivities spread evenly, the first layer the most sensitive."""
    if config.allocation == "uniform":
        return uniform_ratios(n_layers, config.ratio)
    # auto is chosen on the calibration text, which an estimate does not read: the default stands in for it.
    alpha = fixed_alpha(config.alpha)
    return allocate_ratios([math.exp(-index) for index in range(n_layers)], config.ratio, alpha, config.r_max)


def _kept_groups(group: int, kv_heads: int, pruned_heads: int) -> list[int]:
    """Query heads left per key/value group when `pruned_heads` go one from each group in turn (the plan's count
    of the fewest key/value heads emptied)."""
    rounds, extra = divmod(pruned_heads, kv_heads)
    sizes = [group - rounds - (index < extra) for index in range(kv_heads)]
    return [size for size in sizes if size > 0]


def _layer_shape(heads: int, group: int, kv_heads: int, pruned_heads: int, ffn_width: int) -> LayerShape:
    groups = _kept_groups(group, kv_heads, pruned_heads)
    repeat = math.gcd(*groups) if groups else 1
    return LayerShape(heads - pruned_heads, len(groups), sum(size // repeat for size in groups), ffn_width)


def planned_shape(model: PreTrainedModel, config: PruneConfig | None) -> PlannedShape:
    """The model pruned by `config` (a single-ratio config; None: the dense model), from its meta model."""
    layers = decoder_layers(model)
    geometry = attention_geometry(model, layers[0])  # the supported families' decoder layers are all alike
    heads, kv_heads = geometry.num_heads, geometry.num_kv_heads
    group = heads // kv_heads
    width = projections(layers[0]).down.in_features
    if config is None:
        return PlannedShape((_layer_shape(heads, group, kv_heads, 0, width),) * len(layers), dense_params(model))
    if config.shape == UNIFORM_SHAPE:
        uniform = plan_uniform_shape(model, config)
        kept_heads = uniform.kv_heads * uniform.heads_per_kv
        shape = LayerShape(kept_heads, uniform.kv_heads, uniform.kv_heads, width - uniform.pruned_channels)
        shapes = [shape] * len(layers)
    else:
        plan = plan_budget(model, estimated_ratios(len(layers), config), config)
        shapes, removed = [], 0
        for index, layer in enumerate(plan.layers):
            attention = layer.least_attention_removed
            channels = channels_to_prune(plan, index, removed, attention)
            removed += attention + channels * layer.channel_params
            shapes.append(_layer_shape(heads, group, kv_heads, layer.heads, width - channels))
    sizes = Geometry.of(model, config.dtype)  # the dtype does not change the count
    kept = sum(sizes.projection_params(shape) for shape in shapes)
    # FLAP's bias goes on o_proj and down_proj where the model had none.
    bias = config.compensation == MEAN_BIAS_COMPENSATION
    added = bias * len(layers) * sizes.hidden * ((not sizes.o_bias) + (not sizes.mlp_bias))
    return PlannedShape(tuple(shapes), sizes.other_params + kept + added)


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
