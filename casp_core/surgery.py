"""Surgery: masking units in place, and removing them physically.

Masking zeroes a unit's input columns of o_proj / down_proj, which removes its contribution exactly; the
sequential pipeline runs the masked model so that later layers see the earlier layers as pruned. Removal
builds the smaller `CaspLlamaForCausalLM` (or, for the uniform shape, the source family's own class), which must
compute what the masked model computes.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from casp_core.errors import VerificationFailed
from casp_core.model import (
    ATTENTION_PARTS,
    MLP_PARTS,
    AttentionGeometry,
    attention_geometry,
    attention_layer_types,
    decoder_layers,
)
from casp_core.modeling_casp_llama import CaspLlamaConfig, CaspLlamaForCausalLM, even_group_size
from casp_core.plain import plain_config

# Settings of the dense config that describe its uniform layers or its class, not the pruned model, and the
# family settings the pruned config states its own way (Qwen2/3's sliding layers become `layer_types`).
_DENSE_ONLY_KEYS = (
    "model_type",
    "architectures",
    "auto_map",
    "transformers_version",
    "_name_or_path",
    "use_sliding_window",
    "max_window_layers",
)


@dataclass(frozen=True)
class LayerPruning:
    """The units removed from one decoder layer, in the dense layer's numbering."""

    pruned_heads: tuple[int, ...]
    pruned_channels: tuple[int, ...]


def kept(total: int, pruned: tuple[int, ...]) -> list[int]:
    gone = set(pruned)
    return [i for i in range(total) if i not in gone]


def kept_kv_heads(geometry: AttentionGeometry, pruned_heads: tuple[int, ...]) -> list[int]:
    """A key/value head stays while at least one query head that reads it stays."""
    kept_heads = kept(geometry.num_heads, pruned_heads)
    return sorted({geometry.kv_of_query[q] for q in kept_heads})


def head_columns(geometry: AttentionGeometry, heads: list[int]) -> list[int]:
    return [h * geometry.head_dim + i for h in heads for i in range(geometry.head_dim)]


@torch.no_grad()
def mask_layer(layer: nn.Module, geometry: AttentionGeometry, pruning: LayerPruning) -> None:
    layer.self_attn.o_proj.weight[:, head_columns(geometry, list(pruning.pruned_heads))] = 0
    layer.mlp.down_proj.weight[:, list(pruning.pruned_channels)] = 0


# Each gather is one index_select straight into a new tensor: one copy of the kept weights, not two. Rows are
# gathered one at a time (contiguous: a memcpy each). A head's columns are gathered as one block of head_dim
# columns: one strided column at a time, o_proj's gather costs about half again a copy at 4096 x 4096, a block
# at a time about a copy. (Rows are not gathered by blocks: torch's CPU index_select copies slices of 32k
# elements or more one after another, and with two threads that took several times as long as a copy.)
def _rows(linear: nn.Linear, rows: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    tensors = {f"{prefix}.weight": linear.weight.index_select(0, rows)}
    if linear.bias is not None:
        tensors[f"{prefix}.bias"] = linear.bias.index_select(0, rows)
    return tensors


def _columns(linear: nn.Linear, units: torch.Tensor, unit_size: int, prefix: str) -> dict[str, torch.Tensor]:
    """The columns of the kept units, each unit `unit_size` consecutive columns (a head's, or one channel's);
    the bias whole."""
    weight = linear.weight.unflatten(1, (-1, unit_size)).index_select(1, units).flatten(1, 2)
    tensors = {f"{prefix}.weight": weight}
    if linear.bias is not None:
        tensors[f"{prefix}.bias"] = linear.bias.clone()
    return tensors


def _unit_rows(units: torch.Tensor, unit_size: int) -> torch.Tensor:
    """The row numbers of these units, each `unit_size` consecutive rows."""
    return (units[:, None] * unit_size + torch.arange(unit_size, device=units.device)).flatten()


def _kept_index(total: int, pruned: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`kept` as an index tensor, built in torch: a Python list of thousands of ints costs milliseconds."""
    keep = torch.ones(total, dtype=torch.bool, device=device)
    keep[torch.tensor(pruned, dtype=torch.long, device=device)] = False
    return keep.nonzero().flatten()


def _pruned_layer_tensors(
    layer: nn.Module, geometry: AttentionGeometry, pruning: LayerPruning
) -> dict[str, torch.Tensor]:
    """The kept rows and columns of one dense layer's weights, named as in the layer."""
    attention, mlp = layer.self_attn, layer.mlp
    device = attention.q_proj.weight.device
    heads = torch.tensor(kept(geometry.num_heads, pruning.pruned_heads), dtype=torch.long, device=device)
    kv_heads = torch.tensor(kept_kv_heads(geometry, pruning.pruned_heads), dtype=torch.long, device=device)
    channels = _kept_index(mlp.down_proj.in_features, pruning.pruned_channels, mlp.down_proj.weight.device)
    head_rows, kv_rows = _unit_rows(heads, geometry.head_dim), _unit_rows(kv_heads, geometry.head_dim)
    tensors = {
        **_rows(attention.q_proj, head_rows, "self_attn.q_proj"),
        **_rows(attention.k_proj, kv_rows, "self_attn.k_proj"),
        **_rows(attention.v_proj, kv_rows, "self_attn.v_proj"),
        **_columns(attention.o_proj, heads, geometry.head_dim, "self_attn.o_proj"),
        **_rows(mlp.gate_proj, channels, "mlp.gate_proj"),
        **_rows(mlp.up_proj, channels, "mlp.up_proj"),
        **_columns(mlp.down_proj, channels, 1, "mlp.down_proj"),
    }
    for norm in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"{norm}.weight"] = getattr(layer, norm).weight.detach().clone()
    for norm in ("q_norm", "k_norm"):  # Qwen3: over head_dim, shared by all heads, so kept whole
        if hasattr(attention, norm):
            tensors[f"self_attn.{norm}.weight"] = getattr(attention, norm).weight.detach().clone()
    return tensors


def _casp_config(model: PreTrainedModel, kv_maps: list[list[int]], widths: list[int], head_dim: int) -> CaspLlamaConfig:
    layers = decoder_layers(model)
    settings = {k: v for k, v in model.config.to_dict().items() if k not in _DENSE_ONLY_KEYS}
    settings["head_dim"] = head_dim
    # Read from the dense layers themselves: the families differ in which projections carry a bias, and
    # mean-bias compensation gives o_proj and down_proj one.
    attention = layers[0].self_attn
    sliding_window, layer_types = attention_layer_types(model.config)
    settings.update(
        attention_qkv_bias=attention.q_proj.bias is not None,
        attention_o_bias=attention.o_proj.bias is not None,
        mlp_down_bias=layers[0].mlp.down_proj.bias is not None,
        qk_norm=hasattr(attention, "q_norm"),
        sliding_window=sliding_window,
        layer_types=layer_types,
        layer_kv_of_query=kv_maps,
        layer_num_kv_heads=[len(set(kv_map)) for kv_map in kv_maps],
        layer_intermediate_sizes=widths,
        casp=settings.get("casp"),
        architectures=["CaspLlamaForCausalLM"],
    )
    return CaspLlamaConfig(**settings)


def _plain_config(
    model: PreTrainedModel, kv_maps: list[list[int]], widths: list[int], head_dim: int
) -> PretrainedConfig:
    """The source family's own config, for layers that all keep one shape in equal contiguous groups."""
    heads, kv_heads = len(kv_maps[0]), len(set(kv_maps[0]))
    if any(kv_map != kv_maps[0] for kv_map in kv_maps) or len(set(widths)) != 1:
        raise VerificationFailed("the uniform shape left decoder layers of different shapes")
    if even_group_size(kv_maps[0], kv_heads) is None:
        raise VerificationFailed("the uniform shape left key/value groups that repeat_kv cannot express")
    layer = decoder_layers(model)[0]
    return plain_config(
        model.config,
        heads=heads,
        kv_heads=kv_heads,
        ffn_width=widths[0],
        head_dim=head_dim,
        attention_bias=any(getattr(layer.self_attn, p).bias is not None for p in ATTENTION_PARTS),
        mlp_bias=any(getattr(layer.mlp, p).bias is not None for p in MLP_PARTS),
    )


def _layer_shape(model: PreTrainedModel, layer: nn.Module, pruning: LayerPruning) -> tuple[list[int], int]:
    """What a pruned layer keeps, from the pruning alone: its query heads' key/value map and its FFN width."""
    geometry = attention_geometry(model, layer)
    kv_position = {kv: i for i, kv in enumerate(kept_kv_heads(geometry, pruning.pruned_heads))}
    heads = kept(geometry.num_heads, pruning.pruned_heads)
    width = layer.mlp.down_proj.in_features - len(set(pruning.pruned_channels))
    return [kv_position[geometry.kv_of_query[q]] for q in heads], width


@torch.no_grad()
def pruned_skeleton(model: PreTrainedModel, prunings: list[LayerPruning], *, plain: bool = False) -> PreTrainedModel:
    """The smaller model with the dense model's embeddings, final norm and head (shared, not copied) and its
    decoder layers still without weights: `fill_pruned_layer` gives each one its weights.

    A `CaspLlamaForCausalLM`, or with `plain` (the uniform shape) the source model's own class."""
    layers = decoder_layers(model)
    kv_maps, widths = [], []
    for layer, pruning in zip(layers, prunings, strict=True):
        kv_of_query, width = _layer_shape(model, layer, pruning)
        kv_maps.append(kv_of_query)
        widths.append(width)
    head_dim = attention_geometry(model, layers[0]).head_dim
    if plain:
        config, model_class = _plain_config(model, kv_maps, widths, head_dim), type(model)
    else:
        config, model_class = _casp_config(model, kv_maps, widths, head_dim), CaspLlamaForCausalLM
    with torch.device("meta"):
        pruned = model_class(config)
    state = {name: tensor for name, tensor in model.state_dict().items() if not name.startswith("model.layers.")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    unused = pruned.load_state_dict(state, assign=True, strict=False).unexpected_keys
    if unused:
        raise VerificationFailed(f"surgery found no place for dense weights: {', '.join(unused[:5])}")
    if config.tie_word_embeddings:
        pruned.tie_weights()
    device = model.model.embed_tokens.weight.device
    # Non-persistent buffers are not in the state dict: build the rotary tables for real, then take the source
    # model's values, so the pruned model computes what it computes (a model cast with .to(bfloat16) holds
    # bfloat16 inverse frequencies; a fresh table would be float32 and disagree).
    rotary = type(pruned.model.rotary_emb)(config=config).to(device)
    for name, buffer in model.model.rotary_emb.named_buffers():
        setattr(rotary, name, buffer.detach().clone())
    pruned.model.rotary_emb = rotary
    return pruned.eval()


@torch.no_grad()
def fill_pruned_layer(pruned: PreTrainedModel, model: PreTrainedModel, index: int, pruning: LayerPruning) -> None:
    """Layer `index` of `pruned_skeleton`'s model gets the kept rows and columns of the dense layer's weights.

    Where the class has a bias the source had not (Llama's q/k/v beside a compensated o_proj, in the source
    family's own class), it is zero."""
    layer, target = decoder_layers(model)[index], decoder_layers(pruned)[index]
    state = _pruned_layer_tensors(layer, attention_geometry(model, layer), pruning)
    if not isinstance(pruned, CaspLlamaForCausalLM):
        dtype = layer.self_attn.o_proj.weight.dtype
        for name, parameter in target.named_parameters():
            if name.endswith(".bias") and name not in state:
                state[name] = torch.zeros(parameter.shape, dtype=dtype)
    unused = target.load_state_dict(state, assign=True, strict=False).unexpected_keys
    if unused:
        raise VerificationFailed(f"surgery found no place for dense weights: {', '.join(unused[:5])}")
    missing = [name for name, p in target.named_parameters() if p.is_meta]
    if missing:
        raise VerificationFailed(f"surgery left parameters without weights in layer {index}: {', '.join(missing[:5])}")


def remove_units(model: PreTrainedModel, prunings: list[LayerPruning], *, plain: bool = False) -> PreTrainedModel:
    """Build the physically smaller model. `model` may be the dense or the masked model: same result.

    A `CaspLlamaForCausalLM`, or with `plain` (the uniform shape) the source model's own class, where a bias
    the class has and the source had not (Llama's q/k/v beside a compensated o_proj) is zero."""
    pruned = pruned_skeleton(model, prunings, plain=plain)
    for index, pruning in enumerate(prunings):
        fill_pruned_layer(pruned, model, index, pruning)
    return pruned
