"""One decoder layer of the paper's loop: its statistics, Q = (W Wᵀ) ⊙ E[YᵀY], the solver's choice of heads and FFN
channels within the layer's budget, the least-squares compensation of what is kept, and the mask; the calibration
stream then moves on to the next layer. A mixture of experts' layer takes the experts' step instead
(casp_core.method.experts.prune_moe_layer), with this step's plan and its own."""

from dataclasses import dataclass

from torch import nn
from transformers import PreTrainedModel

from casp_core.method.budget import BudgetPlan, UniformShape
from casp_core.method.calibration import (
    CalibrationStream,
    SecondMoment,
    StreamCrossMoment,
    advance_layer,
    check_finite_moments,
    feed_layer,
    record_inputs,
    record_stream_pair,
    run_layer,
    run_layer_on_stream_pair,
)
from casp_core.method.compensation import SharedRefits, compensate_layer
from casp_core.method.results import LayerReport
from casp_core.method.selection import LayerChoice, choose_units, layer_q, params_kept
from casp_core.method.surgery import kept_kv_heads, mask_layer
from casp_core.model import AttentionGeometry, attention_geometry, decoder_layers, sublayer_parameters
from casp_core.run import Run
from casp_core.settings import NO_COMPENSATION, PruneSettings


@dataclass(frozen=True)
class LayerPlan:
    """How every layer chooses its units and compensates the kept ones."""

    solver: str
    compensation: str
    compensation_damping: float

    @classmethod
    def of(cls, settings: PruneSettings) -> "LayerPlan":
        return cls(settings.solver, settings.compensation, settings.compensation_damping)

    @property
    def compensates(self) -> bool:
        return self.compensation != NO_COMPENSATION


def prune_layer(
    model: PreTrainedModel,
    index: int,
    stream: CalibrationStream,
    plan: BudgetPlan | UniformShape,
    removed_before: int,
    layer_plan: LayerPlan,
    run: Run,
    *,
    ratio: float,
    sensitivity: float | None,
) -> LayerReport:
    """Layer `index`: its statistics, its planned heads, then its channels; compensated and masked in place, and
    the stream moved on to the next layer. `removed_before` is what the earlier layers removed; `ratio` and
    `sensitivity` are the allocation's, for the report."""
    layer = decoder_layers(model)[index]
    layer.to(stream.device)
    sublayers = {"attn": layer.self_attn.o_proj, "mlp": layer.mlp.down_proj}
    cross_moments = None
    if stream.dense_inputs is None:
        with run.stage("statistics"), record_inputs(sublayers) as moments:
            if stream.sequential:  # the next layer must see this one as pruned: its inputs come after masking
                feed_layer(layer, stream.inputs, stream.device)
            else:
                dense_outputs = run_layer(layer, stream.inputs, stream.device, stream.store)
    else:
        with run.stage("statistics"), record_stream_pair(sublayers) as recording:
            stream.dense_inputs.batches = run_layer_on_stream_pair(
                layer, stream.inputs, stream.dense_inputs, recording, stream.device, stream.store
            )
        moments, cross_moments = recording.moments, recording.cross_moments
    check_finite_moments(moments, index)
    geometry = attention_geometry(model, layer)
    with run.stage("statistics"):
        q = layer_q(layer, geometry, moments)
    with run.stage("solver"):
        choice = choose_units(layer, geometry, q, moments, plan, index, removed_before, layer_plan.solver)
    report = compensate_and_mask(
        layer,
        geometry,
        choice,
        moments,
        cross_moments,
        layer_plan,
        run,
        index=index,
        ratio=ratio,
        sensitivity=sensitivity,
    )
    del moments, cross_moments, q
    with run.stage("calibration_forward"):
        if stream.sequential:
            advance_layer(layer, stream.inputs, stream.device, stream.store)
        else:
            stream.inputs.batches = dense_outputs
    layer.to(stream.home)
    return report


def compensate_and_mask(
    layer: nn.Module,
    geometry: AttentionGeometry,
    choice: LayerChoice,
    moments: dict[str, SecondMoment],
    cross_moments: dict[str, StreamCrossMoment] | None,
    layer_plan: LayerPlan,
    run: Run,
    *,
    index: int,
    ratio: float,
    sensitivity: float | None,
    refits: SharedRefits | None = None,
) -> LayerReport:
    """The layer's chosen units: the kept ones compensated (from `refits` where the layer's refits are shared)
    and the chosen ones masked, in place."""
    params_before = sum(sublayer_parameters(layer))
    attn, mlp, pruning = choice.attn, choice.mlp, choice.pruning
    if layer_plan.compensates:
        with run.stage("compensation"):
            attn.compensation, mlp.compensation = compensate_layer(
                layer,
                geometry,
                pruning,
                moments,
                layer_plan.compensation,
                layer_plan.compensation_damping,
                cross_moments,
                refits,
            )
    params_after = params_kept(layer, choice)
    kv_kept = kept_kv_heads(geometry, pruning.pruned_heads)
    mask_layer(layer, geometry, pruning)
    return LayerReport(
        index=index,
        ratio=ratio,
        sensitivity=sensitivity,
        pruned_heads=list(pruning.pruned_heads),
        pruned_channels=list(pruning.pruned_channels),
        pruned_kv_heads=[h for h in range(geometry.num_kv_heads) if h not in kv_kept],
        attn=attn,
        mlp=mlp,
        params_before=params_before,
        params_after=params_after,
    )
