"""One decoder layer of a mixture of experts: each expert's statistics, its share of the layer's channels, and its
units chosen, compensated and masked, one expert at a time (docs/moe.md).

Written as one FFN (casp_core.families.moe), the layer's MLP output is down y with y = (w_e(x) y_e(x))_e: expert
e's gated activation y_e(x) = act(gate_e x) ⊙ up_e x scaled by the router's weight w_e(x) where the router picks e
for token x, and zero where it does not. So expert e's statistics are

    C_e = (1/N) Σ_{x routed to e} w_e(x)² y_e(x) y_e(x)ᵀ

over the N calibration tokens (all of them: a token the router sends elsewhere contributes zero), and its
Q_e = (W_eᵀ W_e) ⊙ C_e with W_e its down projection: the diagonal block of the layer's Q for expert e. The blocks
between experts (tokens routed to two experts at once) are left out: they would need every pair of experts'
statistics at once, E² x width² numbers (Qwen3-30B-A3B: 128² x 768² x 8 bytes, 77 GB per layer). Each expert is
chosen, compensated (least squares with its own C_e) and masked on its own block.

The layer's channel count comes from the budget as for a dense layer (the experts' channels one after another);
it is spread over the experts by the paper's layer rule applied to the experts: with S_e = 1ᵀ Q_e 1 = E‖w_e W_e
y_e‖², the energy expert e adds to the layer's output (which grows with the routed mass, the weights squared, and
with what the expert computes), r_e = E' c_e / Σc x r with c_e = (1 - Ŝ_e)^alpha on min-max normalised log S_e
(`allocate_ratios`), r = the layer's count / (E' x width), capped at r_max, over the E' experts that take part.
An expert no calibration token reaches has S_e = 0 and no statistics: it is reported (a warning) and kept whole
unless `moe.prune_unreached`. The uniform shape gives every expert the same count instead.

A shared expert (Qwen2-MoE's, which every token goes through, scaled by σ(shared_expert_gate x)) is one more
expert, numbered after the routed ones, whose weight for every token is that gate.

With `moe.prune_experts`, before the channels, the routed experts with the lowest S_e (measured on the layer's
routing as it was) are removed whole: the router routes as if their rows were gone (casp_core.families.moe
`route_to_kept_experts`), the layer runs again so that the channels' statistics are those of the tokens re-routed
among the kept experts, and the removed experts' channels count first in the layer's budget.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from casp_core.families import family_of_layer
from casp_core.families.base import RowSlice
from casp_core.families.moe import EXPERTS_PATH, ExpertWeights, expert_weights, routed_experts
from casp_core.method.allocation import allocate_ratios
from casp_core.method.budget import BudgetPlan, UniformShape, channel_params, channels_to_prune
from casp_core.method.calibration import CalibrationStream, SecondMoment, advance_layer, feed_layer
from casp_core.method.compensation import CompensationReport, compensate_linear
from casp_core.method.interaction import interaction_matrix, offdiag_ratio
from casp_core.method.layer import LayerPlan
from casp_core.method.results import ExpertReport, LayerReport, SubLayerReport
from casp_core.method.selection import solve_sublayer
from casp_core.model import attention_geometry, decoder_layers, sublayer_parameters
from casp_core.numerics import check_finite
from casp_core.rounding import channel_counts
from casp_core.run import Run
from casp_core.settings import PruneSettings, fixed_alpha


@dataclass(frozen=True)
class ExpertsPlan:
    """How a mixture of experts' layer spreads its channels over its experts, and how many it removes whole."""

    r_max: float
    round_to: int | str
    alpha: float  # the split within a layer keeps the default where alpha is auto (it scores the layers' ratios)
    prune_unreached: bool
    prune_experts: int

    @classmethod
    def of(cls, settings: PruneSettings) -> "ExpertsPlan":
        return cls(
            r_max=settings.r_max,
            round_to=settings.round_to,
            alpha=fixed_alpha(settings.alpha),
            prune_unreached=settings.moe.prune_unreached,
            prune_experts=settings.moe.prune_experts,
        )


@dataclass
class RoutedBatch:
    """One calibration batch at an MoE block: its inputs and the router's picks for them, on the store."""

    hidden: torch.Tensor  # [tokens, hidden]
    experts: torch.Tensor  # [tokens, top_k]
    weights: torch.Tensor  # [tokens, top_k]
    routed_experts: int  # how many the router chooses from
    shared_weights: torch.Tensor | None = None  # [tokens]: the shared expert's gate, where the layer has one

    def routed_to(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens the router sends to `expert` and the weight it gives each; the shared expert (numbered after
        the routed ones) takes every token, weighted by its own gate."""
        if self.shared_weights is not None and expert == self.routed_experts:
            return self.hidden, self.shared_weights
        token, slot = (self.experts == expert).nonzero(as_tuple=True)
        return self.hidden[token], self.weights[token, slot]


@contextmanager
def record_routing(block: nn.Module, store: torch.device) -> Iterator[list[RoutedBatch]]:
    """While active, every forward through the MoE `block` keeps its inputs and its router's top-k picks and
    weights (the router's own output, so exactly the routing the model computes), and the shared expert's gate
    σ(shared_expert_gate x) where the block has one (Qwen2-MoE)."""
    batches: list[RoutedBatch] = []
    shared_gate = getattr(block, "shared_expert_gate", None)

    def keep(router: nn.Module, args: tuple, output: tuple) -> None:
        hidden = args[0].reshape(-1, args[0].shape[-1])
        _, weights, experts = output
        shared = None if shared_gate is None else torch.sigmoid(shared_gate(hidden)).flatten().to(store)
        batches.append(RoutedBatch(hidden.to(store), experts.to(store), weights.to(store), router.num_experts, shared))

    handle = block.gate.register_forward_hook(keep)
    try:
        yield batches
    finally:
        handle.remove()


def weighted_activations(
    expert: ExpertWeights, hidden: torch.Tensor, weights: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """w_e(x) y_e(x) for these tokens: the expert's down-projection inputs, scaled by the router's weight."""
    hidden = hidden.to(device)
    gate = F.linear(hidden, expert.gate)
    return (expert.act(gate) * F.linear(hidden, expert.up)) * weights.to(device, gate.dtype)[:, None]


@torch.no_grad()
def expert_moment(expert: ExpertWeights, number: int, batches: list[RoutedBatch], device: torch.device) -> SecondMoment:
    """C_e = (1/N) Σ_{x routed to e} w_e(x)² y_e(x) y_e(x)ᵀ over all N tokens of `batches` (and E[w_e y_e])."""
    moment = SecondMoment(expert.width, device)
    for batch in batches:
        hidden, weights = batch.routed_to(number)
        moment.update(weighted_activations(expert, hidden, weights, device), tokens=batch.hidden.shape[0])
    return moment


@dataclass
class ExpertTraffic:
    """What the calibration tokens bring one expert, from a pass without statistics."""

    tokens: int  # routed to it
    routed_mass: float  # Σ w_e(x) / N
    sensitivity: float  # S_e = E‖w_e W_e y_e‖² over all N tokens


@torch.no_grad()
def expert_traffic(
    experts: list[ExpertWeights], batches: list[RoutedBatch], device: torch.device
) -> list[ExpertTraffic]:
    total = sum(batch.hidden.shape[0] for batch in batches)
    traffic = []
    for index, expert in enumerate(experts):
        tokens, mass, energy = 0, 0.0, 0.0
        for batch in batches:
            hidden, weights = batch.routed_to(index)
            if hidden.shape[0] == 0:
                continue
            output = F.linear(weighted_activations(expert, hidden, weights, device), expert.down)
            tokens += hidden.shape[0]
            mass += float(weights.double().sum())
            energy += float(output.double().pow(2).sum())
        traffic.append(ExpertTraffic(tokens, mass / total, energy / total))
    return traffic


def lowest_energy_experts(traffic: list[ExpertTraffic], count: int, routed: int) -> list[int]:
    """The `count` routed experts (the first `routed` of `traffic`; a shared expert never) with the lowest S_e, an
    expert no token reached (S_e = 0) first; on a tie the lower number."""
    return sorted(sorted(range(routed), key=lambda e: (traffic[e].sensitivity, e))[:count])


@torch.no_grad()
def remove_experts(
    layer: nn.Module, batches: list[RoutedBatch], count: int, device: torch.device
) -> dict[int, ExpertTraffic]:
    """The layer's `count` routed experts of lowest S_e on `batches`, taken out of its routing (masked); each with
    the traffic that chose it."""
    if count == 0:
        return {}
    traffic = expert_traffic(expert_weights(layer), batches, device)
    removed = lowest_energy_experts(traffic, count, layer.get_submodule(EXPERTS_PATH).num_experts)
    family_of_layer(layer).mask_experts(layer, tuple(removed))
    return {expert: traffic[expert] for expert in removed}


def expert_counts(
    n_channels: int,
    traffic: list[ExpertTraffic],
    widths: list[int],
    experts: ExpertsPlan,
    removed: tuple[int, ...] = (),
) -> tuple[list[int], list[int]]:
    """How many channels each expert (of `widths`) but the `removed` ones prunes, summing to within one rounding
    step of `n_channels`, and the experts (not removed) no token reached."""
    unreached = [e for e, t in enumerate(traffic) if t.tokens == 0 and e not in removed]
    taking_part = [
        e for e in range(len(traffic)) if e not in removed and (e not in unreached or experts.prune_unreached)
    ]
    counts = [0] * len(traffic)
    if n_channels == 0 or not taking_part:
        return counts, unreached
    allowed = {e: channel_counts(widths[e], experts.r_max, experts.round_to) for e in taking_part}
    ratio = min(n_channels / sum(widths[e] for e in taking_part), experts.r_max)
    ratios = allocate_ratios([traffic[e].sensitivity for e in taking_part], ratio, experts.alpha, experts.r_max)
    wanted = {e: r * widths[e] for e, r in zip(taking_part, ratios, strict=True)}
    step = {e: min(range(len(allowed[e])), key=lambda i: abs(allowed[e][i] - wanted[e])) for e in taking_part}
    # Rounding each expert to its nearest count leaves the sum off by a few steps: move one step at a time on the
    # expert whose rounding went furthest the other way, until the next step would overshoot more than it closes.
    while True:
        gap = n_channels - sum(allowed[e][step[e]] for e in taking_part)
        direction = 1 if gap > 0 else -1
        movable = [e for e in taking_part if 0 <= step[e] + direction < len(allowed[e])]
        if gap == 0 or not movable:
            break
        expert = max(movable, key=lambda e: direction * (wanted[e] - allowed[e][step[e]]))
        move = allowed[expert][step[expert] + direction] - allowed[expert][step[expert]]
        if abs(gap - move) >= abs(gap):
            break
        step[expert] += direction
    for e in taking_part:
        counts[e] = allowed[e][step[e]]
    return counts, unreached


@torch.no_grad()
def prune_experts_channels(
    layer: nn.Module,
    batches: list[RoutedBatch],
    plan: BudgetPlan | UniformShape,
    index: int,
    removed_before: int,
    layer_plan: LayerPlan,
    experts_plan: ExpertsPlan,
    run: Run,
    device: torch.device,
    removed: dict[int, ExpertTraffic],
) -> tuple[SubLayerReport, list[ExpertReport]]:
    """The layer's experts' channels for its budget: chosen, compensated and masked one expert at a time, its
    statistics freed before the next one's are taken; the `removed` experts (already out of the routing, with the
    traffic that chose them) lose every channel, which counts first in the budget. Returns the layer's MLP report
    (in the layer's channel numbering) and each expert's."""
    experts = expert_weights(layer)
    widths = [expert.width for expert in experts]
    with run.stage("statistics"):
        traffic = expert_traffic(experts, batches, device)
    removed_channels = sum(widths[e] for e in removed)
    if isinstance(plan, UniformShape):  # the same count in every kept routed expert, reached or not
        routed = len(routed_experts(layer))  # a shared expert, numbered last, is kept whole
        each = (plan.pruned_channels - removed_channels) // (routed - len(removed))
        counts = [widths[e] if e in removed else each if e < routed else 0 for e in range(len(experts))]
        unreached = [e for e, t in enumerate(traffic) if t.tokens == 0 and e not in removed]
    else:
        n_channels = channels_to_prune(plan, index, removed_before, 0) - removed_channels
        counts, unreached = expert_counts(n_channels, traffic, widths, experts_plan, tuple(removed))
        for expert in removed:
            counts[expert] = widths[expert]
    if unreached:
        if isinstance(plan, UniformShape):
            kept = "pruned all the same (shape uniform)"
        elif experts_plan.prune_unreached:
            kept = "pruned all the same (moe.prune_unreached)"
        else:
            kept = "kept whole"
        run.warn(f"layer {index}: no calibration token reached experts {unreached}: {kept}")
    total_tokens = sum(batch.hidden.shape[0] for batch in batches)
    pruned: list[int] = []
    objective = diagonal_objective = offdiag_weighted = q_total = 0.0
    error_before = error_after = damping = 0.0
    reports = []
    for number, (expert, count) in enumerate(zip(experts, counts, strict=True)):
        run.check_cancelled()
        own: list[int] = list(range(expert.width)) if number in removed else []
        if count and number not in removed:
            with run.stage("statistics"):
                moment = expert_moment(expert, number, batches, device)
                q = interaction_matrix(expert.down, moment.second_moment)
                check_finite(q, "interaction", f"Q of expert {number}'s channels", index)
            with run.stage("solver"):
                report = solve_sublayer(layer_plan.solver, q, offdiag_ratio(q), count, expert.down, moment, 1)
            own = report.pruned
            objective += report.objective
            diagonal_objective += report.diagonal_objective
            q_abs = float(q.abs().sum())
            offdiag_weighted += report.offdiag_ratio * q_abs
            q_total += q_abs
            if layer_plan.compensates:
                with run.stage("compensation"):
                    refit = compensate_linear(RowSlice(expert.down), moment, own, layer_plan.compensation_damping)
                error_before += refit.error_before
                error_after += refit.error_after
                damping = max(damping, refit.damping)
            del moment, q
        pruned += [sum(widths[:number]) + channel for channel in own]
        brought = removed.get(number, traffic[number])
        reports.append(
            ExpertReport(
                index=number,
                tokens=brought.tokens,
                token_share=brought.tokens / total_tokens if total_tokens else 0.0,
                routed_mass=brought.routed_mass,
                sensitivity=brought.sensitivity,
                reached=brought.tokens > 0,
                pruned_channels=len(own),
                shared=number >= batches[0].routed_experts if batches else False,
                removed=number in removed,
            )
        )
    family_of_layer(layer).mask_channels(layer, tuple(pruned))
    mlp = SubLayerReport(
        units=sum(widths),
        pruned=pruned,
        objective=objective,
        diagonal_objective=diagonal_objective,
        offdiag_ratio=offdiag_weighted / q_total if q_total else 0.0,
        compensation=None
        if not layer_plan.compensates
        else CompensationReport(error_before=error_before, error_after=error_after, damping=damping),
    )
    return mlp, reports


def prune_moe_layer(
    model: PreTrainedModel,
    index: int,
    stream: CalibrationStream,
    plan: BudgetPlan | UniformShape,
    removed_before: int,
    layer_plan: LayerPlan,
    experts_plan: ExpertsPlan,
    run: Run,
    *,
    ratio: float,
    sensitivity: float | None,
) -> LayerReport:
    """Layer `index` of a mixture of experts, brought to the device for it: attention and the router whole, the
    experts' channels chosen, compensated and masked one expert at a time (`prune_experts_channels`), and the stream
    moved on. Its family refuses, before any work, the settings this does not take (dense calibration,
    dense-target and mean-bias compensation)."""
    assert stream.sequential and stream.dense_inputs is None
    layer = decoder_layers(model)[index]
    layer.to(stream.device)
    params_before = sum(sublayer_parameters(layer))
    with run.stage("statistics"), record_routing(layer.mlp, stream.store) as batches:
        feed_layer(layer, stream.inputs, stream.device)
    with run.stage("statistics"):
        removed = remove_experts(layer, batches, experts_plan.prune_experts, stream.device)
    if removed:  # the channels' statistics from the tokens as the kept experts now take them
        with run.stage("statistics"), record_routing(layer.mlp, stream.store) as batches:
            feed_layer(layer, stream.inputs, stream.device)
    mlp, experts = prune_experts_channels(
        layer, batches, plan, index, removed_before, layer_plan, experts_plan, run, stream.device, removed
    )
    del batches
    with run.stage("calibration_forward"):
        advance_layer(layer, stream.inputs, stream.device, stream.store)
    geometry = attention_geometry(model, layer)
    layer.to(stream.home)
    return LayerReport(
        index=index,
        ratio=ratio,
        sensitivity=sensitivity,
        pruned_heads=[],
        pruned_channels=list(mlp.pruned),
        pruned_kv_heads=[],
        attn=SubLayerReport(
            units=geometry.num_heads, pruned=[], objective=0.0, diagonal_objective=0.0, offdiag_ratio=0.0
        ),
        mlp=mlp,
        params_before=params_before,
        params_after=params_before - len(mlp.pruned) * channel_params(layer),
        experts=experts,
    )
