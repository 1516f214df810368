"""The shape of a pruned model, from the dense model's config alone: before any statistics, so that a budget can be
turned into candidates (casp_core.job.sweep.candidates) and an impossible one refused at submit.

The shape is the budget plan's (casp_core.method.budget), made for a model of that config built on the meta device
(no weights): the per-layer ratios the allocation would give if the layers' sensitivities were spread evenly, from
the first layer, the most sensitive (r_l = 0, as min-max normalisation gives the most sensitive layer), to the last
(`allocation: uniform` and `shape: uniform` as they are); each layer's heads as the plan fixes them; its FFN
channels as the pruning takes them, layer by layer, from the plan; key/value heads emptied as the plan counts them
(the fewest). What a real job removes is within half a rounding unit of the same total; which layers give more
depends on the sensitivities, which the estimate cannot know. Its files' bytes: casp_core.artifacts.gguf.size and
casp_core.artifacts.compressed_tensors.size (README, "Prune to a budget", states how close).
"""

import math

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from casp_core.artifacts.shapes import Geometry, LayerShape, PlannedShape, dense_params
from casp_core.families import projections
from casp_core.method.allocation import allocate_ratios, uniform_ratios
from casp_core.method.budget import AllocationPlan, channels_to_prune, plan_budget, plan_uniform_shape
from casp_core.method.prune import PrunePlan
from casp_core.model import attention_geometry, decoder_layers
from casp_core.settings import MEAN_BIAS_COMPENSATION, fixed_alpha


def meta_model(model_config: PretrainedConfig) -> PreTrainedModel:
    """The model of `model_config` without weights: its modules and shapes, for the budget plan."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


def estimated_ratios(n_layers: int, allocation: AllocationPlan) -> list[float]:
    """The per-layer ratios of sensitivities spread evenly, the first layer the most sensitive."""
    if allocation.allocation == "uniform":
        return uniform_ratios(n_layers, allocation.ratio)
    # auto is chosen on the calibration text, which an estimate does not read: the default stands in for it.
    alpha = fixed_alpha(allocation.alpha)
    return allocate_ratios([math.exp(-index) for index in range(n_layers)], allocation.ratio, alpha, allocation.r_max)


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


def planned_shape(model: PreTrainedModel, prune: PrunePlan | None) -> PlannedShape:
    """The model pruned as `prune` says (None: the dense model), from its meta model."""
    layers = decoder_layers(model)
    geometry = attention_geometry(model, layers[0])  # the supported families' decoder layers are all alike
    heads, kv_heads = geometry.num_heads, geometry.num_kv_heads
    group = heads // kv_heads
    width = projections(layers[0]).down.in_features
    if prune is None:
        return PlannedShape((_layer_shape(heads, group, kv_heads, 0, width),) * len(layers), dense_params(model))
    allocation = prune.allocation
    if allocation.uniform_shape:
        uniform = plan_uniform_shape(model, allocation)
        kept_heads = uniform.kv_heads * uniform.heads_per_kv
        shape = LayerShape(kept_heads, uniform.kv_heads, uniform.kv_heads, width - uniform.pruned_channels)
        shapes = [shape] * len(layers)
    else:
        plan = plan_budget(model, estimated_ratios(len(layers), allocation), allocation)
        shapes, removed = [], 0
        for index, layer in enumerate(plan.layers):
            attention = layer.least_attention_removed
            channels = channels_to_prune(plan, index, removed, attention)
            removed += attention + channels * layer.channel_params
            shapes.append(_layer_shape(heads, group, kv_heads, layer.heads, width - channels))
    sizes = Geometry.of(model, "auto")  # the dtype does not change the count
    kept = sum(sizes.projection_params(shape) for shape in shapes)
    # FLAP's bias goes on o_proj and down_proj where the model had none.
    bias = prune.layer.compensation == MEAN_BIAS_COMPENSATION
    added = bias * len(layers) * sizes.hidden * ((not sizes.o_bias) + (not sizes.mlp_bias))
    return PlannedShape(tuple(shapes), sizes.other_params + kept + added)
