"""One decoder layer of the paper's loop: its statistics, Q = (W Wᵀ) ⊙ E[YᵀY], the solver's choice of heads and FFN
channels within the layer's budget, the least-squares compensation of what is kept, and the mask; the calibration
stream then moves on to the next layer. A mixture of experts' layer takes the experts' step
(casp_core.method.experts.prune_moe_layer)."""

from torch import nn
from transformers import PreTrainedModel

from casp_core.families import family_of
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
from casp_core.method.experts import prune_moe_layer
from casp_core.method.results import LayerReport
from casp_core.method.selection import LayerChoice, choose_units, layer_q, params_kept
from casp_core.method.surgery import kept_kv_heads, mask_layer
from casp_core.model import AttentionGeometry, attention_geometry, decoder_layers, sublayer_parameters
from casp_core.run import Run
from casp_core.settings import PruneConfig


def prune_layer(
    model: PreTrainedModel,
    index: int,
    stream: CalibrationStream,
    plan: BudgetPlan | UniformShape,
    removed_before: int,
    config: PruneConfig,
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
    if family_of(model.config).has_experts:
        report = prune_moe_layer(
            model, index, stream, plan, removed_before, config, run, ratio=ratio, sensitivity=sensitivity
        )
        layer.to(stream.home)
        return report
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
        choice = choose_units(layer, geometry, q, moments, plan, index, removed_before, config.solver)
    report = compensate_and_mask(
        layer, geometry, choice, moments, cross_moments, config, run, index=index, ratio=ratio, sensitivity=sensitivity
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
    config: PruneConfig,
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
    if config.compensation != "none":
        with run.stage("compensation"):
            attn.compensation, mlp.compensation = compensate_layer(
                layer,
                geometry,
                pruning,
                moments,
                config.compensation,
                config.compensation_damping,
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
