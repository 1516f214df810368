"""From ratios to unit counts: how many heads and FFN channels each layer prunes, planned before any statistics."""

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from casp_core.errors import InvalidConfig
from casp_core.families import family_of, family_of_layer, projections
from casp_core.method.surgery import kept_kv_heads
from casp_core.model import (
    AttentionGeometry,
    attention_geometry,
    decoder_layers,
    prunable_parameters,
    sublayer_parameters,
)
from casp_core.rounding import aligned_heads, head_multiple, quantizer_block, round_to_for
from casp_core.settings import AUTO_ALPHA, UNIFORM_SHAPE, PruneSettings

# The budget is planned from the ratios and the shapes alone, before any statistics: in sequential mode layer l
# is masked before layer l+1 is measured, so a shortfall found after the last layer could not go back to the
# earlier ones. Each layer prunes round(r_l x heads) query heads and FFN channels for the rest of its share,
# never more than r_max of either. Where layers at r_max cannot hold the target that way (whole heads round
# down), heads go first to the layers whose rounding cut most, and only then do layers the allocation spared
# (r_l = 0) take part. Channels are then chosen layer by layer: the layer's share plus what the earlier layers
# still owe, but at least what the later layers cannot hold and at most what leaves them their least, so the
# last layer's channels close the gap to within half a rounding unit (round_to FFN channels of one layer).
# Only how many key/value heads the chosen query heads take along (GQA) is not known in advance: the plan
# counts the fewest, and the channels of the later layers absorb the difference.
# A family that keeps attention whole (Family.prunes_heads False) plans no head in any layer: its ratio, still of
# the attention and MLP parameters together, is met by FFN channels alone, or refused where r_max cannot hold it.
# A job that exports a quantized GGUF moves a layer's head count by one where that makes o_proj's rows (kept
# heads x head_dim) a multiple of the quantizer's block (casp_core.rounding.aligned_heads); the channels absorb it.


@dataclass(frozen=True)
class AllocationPlan:
    """What the allocation and the budget read: the ratio, how it is spread over the layers, and in which units."""

    ratio: float
    alpha: float | str  # a number, or "auto" (casp_core.method.temperature)
    allocation: str  # "gradient" | "uniform"
    shape: str  # "per_layer" | "uniform"
    r_max: float
    round_to: int | str
    block: int | None  # the quantizer's block a quantized GGUF export's widths fit; None without one
    gguf_type: str | None  # that export's type; None without one
    prune_experts: int  # whole routed experts each layer of a mixture of experts removes

    @classmethod
    def of(cls, settings: PruneSettings) -> "AllocationPlan":
        """The allocation single-ratio `settings` ask for (a sweep plans each candidate's own settings)."""
        assert settings.ratio is not None, "a sweep plans each candidate's single-ratio settings"
        block = quantizer_block(settings)
        return cls(
            ratio=settings.ratio,
            alpha=settings.alpha,
            allocation=settings.allocation,
            shape=settings.shape,
            r_max=settings.r_max,
            round_to=settings.round_to,
            block=block,
            gguf_type=settings.gguf_type if block else None,
            prune_experts=settings.moe.prune_experts,
        )

    @property
    def uniform_shape(self) -> bool:
        return self.shape == UNIFORM_SHAPE

    @property
    def uses_sensitivities(self) -> bool:
        """Whether the layer ratios come from the gradient sensitivities S_l (the uniform shape and allocation do
        not read them)."""
        return not self.uniform_shape and self.allocation == "gradient"

    @property
    def alpha_auto(self) -> bool:
        return self.alpha == AUTO_ALPHA


def attention_params_removed(layer: nn.Module, geometry: AttentionGeometry, heads: list[int]) -> int:
    """q rows and o columns of each head, plus k and v rows of each key/value head left with no query head."""
    parts = projections(layer)
    hidden = parts.q.in_features
    per_head = geometry.head_dim * (2 * hidden + (parts.q.bias is not None))
    per_kv_head = 2 * geometry.head_dim * (hidden + (parts.k.bias is not None))
    kv_gone = geometry.num_kv_heads - len(kept_kv_heads(geometry, tuple(heads)))
    return len(heads) * per_head + kv_gone * per_kv_head


def channel_params(layer: nn.Module) -> int:
    parts = projections(layer)
    return parts.down.out_features + 2 * (parts.gate.in_features + (parts.gate.bias is not None))


def layer_channel_counts(layer: nn.Module, allocation: AllocationPlan) -> tuple[int, ...]:
    """The FFN channel counts the layer may prune, as its family counts them (a mixture of experts: sums of its
    experts' counts, after its removed experts' channels)."""
    return family_of_layer(layer).channel_counts(
        layer, allocation.r_max, allocation.round_to, allocation.block, allocation.prune_experts
    )


def heads_cap(model: PreTrainedModel, geometry: AttentionGeometry, r_max: float) -> int:
    """The most query heads a layer may prune: r_max of them, none where the family keeps attention whole."""
    if not family_of(model.config).prunes_heads:
        return 0
    return int(r_max * geometry.num_heads + 1e-9)


def heads_emptying_groups_last(geometry: AttentionGeometry) -> list[int]:
    """Query heads ordered one from each key/value group, then a second from each...: any prefix of this order
    takes along the fewest key/value heads that so many query heads can."""
    seen: Counter[int] = Counter()
    rank = []
    for kv in geometry.kv_of_query:
        rank.append(seen[kv])
        seen[kv] += 1
    return sorted(range(geometry.num_heads), key=lambda head: (rank[head], head))


@dataclass(frozen=True)
class LayerBudget:
    """One layer's part of the budget: its query heads, fixed, and the FFN channel counts it may choose from."""

    heads: int
    least_attention_removed: int  # parameters those heads remove when they take along the fewest key/value heads
    channel_params: int
    channel_counts: tuple[int, ...]  # ascending
    share: float  # r_l times the layer's parameters

    @property
    def least_removed(self) -> int:
        return self.least_attention_removed + self.channel_counts[0] * self.channel_params

    @property
    def most_removed(self) -> int:
        return self.least_attention_removed + self.channel_counts[-1] * self.channel_params


@dataclass(frozen=True)
class BudgetPlan:
    target: float  # parameters to remove: the ratio times the dense decoder layers' parameters
    layers: tuple[LayerBudget, ...]


def layer_budget(
    model: PreTrainedModel, layer: nn.Module, heads: int, counts: tuple[int, ...], ratio: float
) -> LayerBudget:
    geometry = attention_geometry(model, layer)
    return LayerBudget(
        heads=heads,
        least_attention_removed=attention_params_removed(layer, geometry, heads_emptying_groups_last(geometry)[:heads]),
        channel_params=channel_params(layer),
        channel_counts=counts,
        share=ratio * sum(sublayer_parameters(layer)),
    )


def check_reachable(model: PreTrainedModel, allocation: AllocationPlan) -> None:
    """Refuse, before any work, a ratio that whole heads and channels within r_max cannot reach (casp_core.job.plan
    calls it for every job, on a model built on the meta device when no weights are loaded)."""
    if allocation.uniform_shape:
        plan_uniform_shape(model, allocation)  # refuses what the uniform shape cannot reach
        return
    most = 0
    for layer in decoder_layers(model):
        counts = layer_channel_counts(layer, allocation)
        cap = heads_cap(model, attention_geometry(model, layer), allocation.r_max)
        most += layer_budget(model, layer, cap, counts, allocation.r_max).most_removed
    if allocation.ratio > most / prunable_parameters(model) + 1e-9:
        raise unreachable(model, allocation, most)


def unreachable(model: PreTrainedModel, allocation: AllocationPlan, most: int) -> InvalidConfig:
    """The refusal of `allocation.ratio` where the layers remove at most `most` parameters."""
    reachable = most / prunable_parameters(model)
    rounding = f" and round_to = {allocation.round_to}" if allocation.round_to != 1 else ""
    family = family_of(model.config)
    units = (
        "whole heads and FFN channels"
        if family.prunes_heads
        else f"FFN channels alone ({family.name} keeps attention whole)"
    )
    return InvalidConfig(
        f"ratio: {allocation.ratio} cannot be reached on this model: {units}, at most "
        f"r_max = {allocation.r_max} of each layer's{rounding}, remove at most {math.floor(reachable * 1e4) / 1e4} "
        "of the decoder layers' parameters (ask for that or less, or raise r_max)"
    )


def plan_budget(model: PreTrainedModel, ratios: list[float], allocation: AllocationPlan) -> BudgetPlan:
    """Heads per layer and the channel counts each may take, such that the layers can hold the target."""
    layers = decoder_layers(model)
    geometries = [attention_geometry(model, layer) for layer in layers]
    block = allocation.block
    counts = [layer_channel_counts(layer, allocation) for layer in layers]
    caps = [heads_cap(model, geometry, allocation.r_max) for geometry in geometries]
    multiples = [head_multiple(block, geometry.head_dim) for geometry in geometries]
    heads = [
        aligned_heads(r * g.num_heads, min(round(r * g.num_heads), cap), g.num_heads, multiple, cap)
        for r, g, cap, multiple in zip(ratios, geometries, caps, multiples, strict=True)
    ]
    spared = [r <= 0.0 for r in ratios]
    # A layer the allocation spares keeps every channel, except where a quantized GGUF's block is its unit: then
    # the fewest that leave whole blocks go, or its ffn_down would take a fallback type.
    spared_counts = [
        (count[0],)
        if block and round_to_for(projections(layer).down.in_features, allocation.round_to, block) == block
        else (0,)
        for count, layer in zip(counts, layers, strict=True)
    ]

    def plan_of(index: int) -> LayerBudget:
        if spared[index]:
            return layer_budget(model, layers[index], 0, spared_counts[index], 0.0)
        return layer_budget(model, layers[index], heads[index], counts[index], ratios[index])

    plans = [plan_of(index) for index in range(len(layers))]
    target = allocation.ratio * prunable_parameters(model)
    while sum(plan.most_removed for plan in plans) < target:
        growing = [i for i in range(len(layers)) if not spared[i] and heads[i] < caps[i]]
        if growing:
            index = max(growing, key=lambda i: ratios[i] * geometries[i].num_heads - heads[i])
            # One more head, or two where that keeps o_proj's rows a multiple of the quantizer's block (aimed at
            # two more, so that of a move back and a move on, the move on wins).
            more = aligned_heads(
                heads[index] + 2, heads[index] + 1, geometries[index].num_heads, multiples[index], caps[index]
            )
            heads[index] = more if more > heads[index] else heads[index] + 1
        elif any(spared):
            index = spared.index(True)
            spared[index] = False
        else:
            # Every layer at r_max: the plan refused the job before any work (check_reachable); this is a caller
            # of `prune` that did not plan, told the same after its calibration.
            raise unreachable(model, allocation, sum(plan.most_removed for plan in plans))
        plans[index] = plan_of(index)
    return BudgetPlan(target, tuple(plans))


def channels_to_prune(plan: BudgetPlan, index: int, removed_before: int, attention_removed: int) -> int:
    """Layer `index`'s share and what the earlier layers still owe, within what the later layers can hold.

    `removed_before` is what the earlier layers removed, `attention_removed` what this layer's heads removed
    with the key/value heads they took along.
    """
    layer, later = plan.layers[index], plan.layers[index + 1 :]
    owed = plan.target - removed_before - attention_removed  # by this layer's channels and the later layers
    least = owed - sum(p.most_removed for p in later)
    most = owed - sum(p.least_removed for p in later)
    owed_before = sum(p.share for p in plan.layers[:index]) - removed_before
    wanted = max(min(layer.share - attention_removed + owed_before, most), least) / layer.channel_params
    return min(layer.channel_counts, key=lambda count: abs(count - wanted))


# ---------------------------------------------------------------- the uniform shape


@dataclass(frozen=True)
class UniformShape:
    """Every layer's budget in the uniform shape: it keeps `kv_heads` key/value heads with `heads_per_kv` query
    heads each, and prunes `pruned_channels` FFN channels. Which units go is still the solver's choice per layer."""

    kv_heads: int
    heads_per_kv: int
    pruned_channels: int


def representative_heads(geometry: AttentionGeometry, kv_heads: int, heads_per_kv: int) -> list[int]:
    """Some query heads whose removal leaves that shape: the last groups whole, the last heads of the others.
    Every such set removes the same parameters, so it stands for all of them in the count."""
    group = geometry.num_heads // geometry.num_kv_heads
    return [h for h in range(geometry.num_heads) if h // group >= kv_heads or h % group >= heads_per_kv]


def plan_uniform_shape(model: PreTrainedModel, allocation: AllocationPlan) -> UniformShape:
    """The one shape every layer takes: the ratio spread evenly over the layers, as `allocation: uniform` does.

    Heads: the count the per-layer rule gives at r_l = ratio, moved to the nearest one the family's class can
    hold (whole key/value groups times equal query heads per group, within r_max; LlamaConfig also needs it to
    divide hidden_size); on a tie the larger count, whose rest the finer FFN channels take, then the fewer
    key/value heads (a smaller KV cache). Channels: the rest of the layer's share, to the nearest count, so the
    achieved ratio is within half a rounding unit (round_to channels in every layer) of the target.
    """
    family = family_of(model.config)
    layers = decoder_layers(model)
    layer = layers[0]  # the supported families' decoder layers are all alike
    geometry = attention_geometry(model, layer)
    group = geometry.num_heads // geometry.num_kv_heads
    cap = heads_cap(model, geometry, allocation.r_max)
    block = allocation.block
    exact = allocation.ratio * geometry.num_heads
    pruned_heads = aligned_heads(exact, round(exact), geometry.num_heads, head_multiple(block, geometry.head_dim), cap)
    wanted_heads = geometry.num_heads - pruned_heads
    choices = sorted(
        (
            (kv, per)
            for kv in range(1, geometry.num_kv_heads + 1)
            for per in range(1, group + 1)
            if family.allows_head_count(model.config, kv * per) and geometry.num_heads - kv * per <= cap
        ),
        key=lambda choice: (abs(choice[0] * choice[1] - wanted_heads), -choice[0] * choice[1], -choice[1]),
    )
    counts = family.uniform_channel_counts(
        layer, allocation.r_max, allocation.round_to, block, allocation.prune_experts
    )
    per_channel = channel_params(layer)
    share = allocation.ratio * prunable_parameters(model) / len(layers)
    half_unit = round_to_for(projections(layer).down.in_features, allocation.round_to, block) * per_channel / 2
    for kv, per in choices:
        rest = share - attention_params_removed(layer, geometry, representative_heads(geometry, kv, per))
        # The nearest head count first; a further one only where the channels cannot close the gap with it.
        if counts[0] * per_channel - half_unit <= rest <= counts[-1] * per_channel + half_unit:
            pruned_channels = min(counts, key=lambda count: abs(count * per_channel - rest))
            return UniformShape(kv, per, pruned_channels)
    raise InvalidConfig(
        f"ratio: {allocation.ratio} cannot be reached with shape uniform on this model: every layer keeping the same "
        f"whole heads (a count its {type(model.config).__name__} accepts) and FFN channels, at most r_max = "
        f"{allocation.r_max} of each; ask for another ratio, raise r_max or use shape per_layer"
    )


def rounding_units(model: PreTrainedModel, allocation: AllocationPlan) -> dict[str, Any]:
    """The units the layers are pruned in: each layer's FFN multiple, the multiple of query heads that keeps
    o_proj's rows a multiple of the quantizer's block (1 without a quantized GGUF), and one rounding unit (the
    largest layer's round_to FFN channels) as a fraction of the decoder layers' parameters, which bounds how far
    the achieved ratio is from the target."""
    block = allocation.block
    layers = decoder_layers(model)
    multiples = [round_to_for(projections(layer).down.in_features, allocation.round_to, block) for layer in layers]
    largest = max(multiple * channel_params(layer) for multiple, layer in zip(multiples, layers, strict=True))
    return {
        "block": block,
        "gguf_type": allocation.gguf_type,
        "ffn_multiples": multiples,
        "head_multiple": head_multiple(block, attention_geometry(model, layers[0]).head_dim),
        "one_unit": largest / prunable_parameters(model),
    }
