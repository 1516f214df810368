"""Surgery: masking units in place, and removing them physically.

Masking zeroes a unit's input columns of o_proj / down_proj, which removes its contribution exactly; the
sequential pipeline runs the masked model so that later layers see the earlier layers as pruned. Removal
builds the smaller model of the family's per-layer class (casp_core.families; `CaspLlamaForCausalLM` for the
LLaMA-layout families) or, for the uniform shape, the source family's own class, which must compute what the
masked model computes. What is cut from each layer is the family's (Family.pruned_layer_tensors).
"""

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from casp_core.errors import VerificationFailed
from casp_core.families import family_of, family_of_layer
from casp_core.families.modeling.modeling_casp_llama import even_group_size
from casp_core.model import attention_geometry, decoder_layers
from casp_core.units import AttentionGeometry, LayerPruning, kept, kept_kv_heads


def head_columns(geometry: AttentionGeometry, heads: list[int]) -> list[int]:
    return [h * geometry.head_dim + i for h in heads for i in range(geometry.head_dim)]


@torch.no_grad()
def mask_layer(layer: nn.Module, geometry: AttentionGeometry, pruning: LayerPruning) -> None:
    layer.self_attn.o_proj.weight[:, head_columns(geometry, list(pruning.pruned_heads))] = 0
    family = family_of_layer(layer)
    family.mask_channels(layer, pruning.pruned_channels)
    if pruning.removed_experts:
        family.mask_experts(layer, pruning.removed_experts)


def _plain_config(
    model: PreTrainedModel, kv_maps: list[list[int]], widths: list[int], head_dim: int
) -> PretrainedConfig:
    """The source family's own config, for layers that all keep one shape in equal contiguous groups."""
    heads, kv_heads = len(kv_maps[0]), len(set(kv_maps[0]))
    if any(kv_map != kv_maps[0] for kv_map in kv_maps) or len(set(widths)) != 1:
        raise VerificationFailed("the uniform shape left decoder layers of different shapes")
    if even_group_size(kv_maps[0], kv_heads) is None:
        raise VerificationFailed("the uniform shape left key/value groups that repeat_kv cannot express")
    family = family_of(model.config)
    parts = family.projections(decoder_layers(model)[0])
    return family.plain_config(
        model.config,
        heads=heads,
        kv_heads=kv_heads,
        ffn_width=widths[0],
        head_dim=head_dim,
        attention_bias=any(p.bias is not None for p in parts.attention),
        mlp_bias=any(p.bias is not None for p in parts.mlp),
    )


def _layer_shape(
    model: PreTrainedModel, layer: nn.Module, pruning: LayerPruning
) -> tuple[list[int], int | tuple[int, ...]]:
    """What a pruned layer keeps, from the pruning alone: its query heads' key/value map and its FFN width (a
    mixture of experts: each expert's)."""
    geometry = attention_geometry(model, layer)
    kv_position = {kv: i for i, kv in enumerate(kept_kv_heads(geometry, pruning.pruned_heads))}
    heads = kept(geometry.num_heads, pruning.pruned_heads)
    width = family_of(model.config).kept_width(layer, pruning)
    return [kv_position[geometry.kv_of_query[q]] for q in heads], width


@torch.no_grad()
def pruned_skeleton(model: PreTrainedModel, prunings: list[LayerPruning], *, plain: bool = False) -> PreTrainedModel:
    """The smaller model with the dense model's embeddings, final norm and head (shared, not copied) and its
    decoder layers still without weights: `fill_pruned_layer` gives each one its weights.

    The family's per-layer class (`CaspLlamaForCausalLM` for the LLaMA-layout families), or with `plain` (the
    uniform shape) the source model's own class."""
    family = family_of(model.config)
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
        config, model_class = family.pruned_config(model, kv_maps, widths, head_dim), family.pruned_model_class
    with torch.device("meta"):
        pruned = model_class(config)
    if plain:  # the family's own class: what the masked model runs (a mixture of experts' eager experts)
        family.prepare(pruned)
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
    # The other buffers outside the decoder layers (Gemma's embedding scale, sqrt(hidden_size) in the weights'
    # dtype), likewise the source model's values.
    for name, buffer in model.named_buffers():
        if not name.startswith(("model.layers.", "model.rotary_emb.")):
            module, _, buffer_name = name.rpartition(".")
            setattr(pruned.get_submodule(module), buffer_name, buffer.detach().clone())
    return pruned.eval()


@torch.no_grad()
def fill_pruned_layer(pruned: PreTrainedModel, model: PreTrainedModel, index: int, pruning: LayerPruning) -> None:
    """Layer `index` of `pruned_skeleton`'s model gets the kept rows and columns of the dense layer's weights.

    Where the class has a bias the source had not (Llama's q/k/v beside a compensated o_proj, in the source
    family's own class), it is zero."""
    family = family_of(model.config)
    layer, target = decoder_layers(model)[index], decoder_layers(pruned)[index]
    state = family.pruned_layer_tensors(layer, attention_geometry(model, layer), pruning)
    if not isinstance(pruned, family.pruned_model_class):
        state = family.plain_layer_tensors(state)
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

    The family's per-layer class, or with `plain` (the uniform shape) the source model's own class, where a bias
    the class has and the source had not (Llama's q/k/v beside a compensated o_proj) is zero."""
    pruned = pruned_skeleton(model, prunings, plain=plain)
    for index, pruning in enumerate(prunings):
        fill_pruned_layer(pruned, model, index, pruning)
    return pruned
