"""Pruning a loaded model: allocate the ratio over layers, then layer by layer measure, choose, compensate, mask;
at the end remove the masked units and verify that the smaller model computes what the masked one computes.

`prune_layer` is one layer of the paper's loop (statistics -> Q -> solver -> compensation -> mask); `prune`
is the loop, with the allocation before it and surgery and verification after it.
"""

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.allocation import allocate_ratios, layer_sensitivities, uniform_ratios
from casp_core.budget import (
    BudgetPlan,
    UniformShape,
    attention_params_removed,
    channel_params,
    channels_to_prune,
    check_reachable,
    plan_budget,
    plan_uniform_shape,
)
from casp_core.calibration import (
    LayerInputs,
    SecondMoment,
    calibration_windows,
    capture_first_layer_inputs,
    check_finite_moments,
    record_inputs,
    record_stream_pair,
    run_layer,
    run_layer_on_stream_pair,
)
from casp_core.compensation import compensate_layer
from casp_core.config import DENSE_TARGET_COMPENSATION, UNIFORM_SHAPE, PruneConfig
from casp_core.interaction import block_aggregate, interaction_matrix, objective, offdiag_ratio
from casp_core.model import (
    AttentionGeometry,
    attention_geometry,
    decoder_layers,
    prunable_parameters,
    resolve_device,
    sublayer_parameters,
)
from casp_core.numerics import check_finite
from casp_core.results import LayerReport, PruneResult, SubLayerReport
from casp_core.run import Run
from casp_core.solvers import diagonal, select_units
from casp_core.surgery import (
    LayerPruning,
    fill_pruned_layer,
    head_columns,
    kept_kv_heads,
    mask_layer,
    pruned_skeleton,
)
from casp_core.verification import verify


@dataclass
class CalibrationStream:
    """The activations entering the current layer, on `store` between layers, and where layers run."""

    inputs: LayerInputs
    dense_inputs: LayerInputs | None  # the dense model's, beside the pruned ones: dense-target compensation only
    sequential: bool  # each layer sees the earlier ones pruned (else: the dense model's activations)
    device: torch.device
    store: torch.device


def solve_sublayer(
    solver: str, q_units: torch.Tensor, k: int, weight: torch.Tensor, moment: SecondMoment, block: int
) -> SubLayerReport:
    pruned, lower_bound = select_units(
        solver, q_units, k, weight=weight, second_moment=moment.second_moment, mean=moment.mean, block=block
    )
    return SubLayerReport(
        units=q_units.shape[0],
        pruned=sorted(int(i) for i in pruned),
        objective=objective(q_units, pruned),
        diagonal_objective=objective(q_units, diagonal(q_units, k)),
        offdiag_ratio=offdiag_ratio(q_units),
        lower_bound=lower_bound,
    )


def solve_uniform_heads(
    solver: str,
    q_heads: torch.Tensor,
    geometry: AttentionGeometry,
    shape: UniformShape,
    weight: torch.Tensor,
    moment: SecondMoment,
) -> SubLayerReport:
    """The uniform shape's heads: `shape.kv_heads` whole key/value groups stay, each with `shape.heads_per_kv`
    query heads, so that LLaMA's repeat_kv (one key/value head per equal contiguous group) still holds.

    Two choices by the same solver on the same Q. Groups first, on the group-aggregated Q (Q̃ summed over each
    group's query heads, as heads are Q summed over their head_dim columns): a group's cost is that of all its
    query heads together, and its key and value rows go with it. Then, in each kept group alone, the query heads
    to drop on that group's block of Q. The second step leaves out the interactions between heads of different
    groups: the fixed count per group is a constraint of each group, and solving each group on its own lets every
    solver (greedy, relaxation, wanda_sp, ...) apply unchanged. Under MHA the groups are the heads themselves.
    """
    groups = {kv: [q for q, k in enumerate(geometry.kv_of_query) if k == kv] for kv in range(geometry.num_kv_heads)}
    group_size = geometry.num_heads // geometry.num_kv_heads
    pruned: list[int] = []
    if shape.kv_heads < geometry.num_kv_heads:
        q_groups = block_aggregate(q_heads, group_size)
        gone, _ = select_units(
            solver,
            q_groups,
            geometry.num_kv_heads - shape.kv_heads,
            weight=weight,
            second_moment=moment.second_moment,
            mean=moment.mean,
            block=group_size * geometry.head_dim,
        )
        pruned += [q for kv in gone.tolist() for q in groups[kv]]
        groups = {kv: heads for kv, heads in groups.items() if kv not in set(gone.tolist())}
    if shape.heads_per_kv < group_size:
        for heads in groups.values():
            columns = head_columns(geometry, heads)
            gone, _ = select_units(
                solver,
                q_heads[heads][:, heads],
                group_size - shape.heads_per_kv,
                weight=weight[:, columns],
                second_moment=moment.second_moment[columns][:, columns],
                mean=moment.mean[columns],
                block=geometry.head_dim,
            )
            pruned += [heads[i] for i in gone.tolist()]
    chosen = torch.tensor(sorted(pruned), dtype=torch.int64)
    return SubLayerReport(
        units=q_heads.shape[0],
        pruned=sorted(pruned),
        objective=objective(q_heads, chosen),
        diagonal_objective=objective(q_heads, diagonal(q_heads, len(pruned))),
        offdiag_ratio=offdiag_ratio(q_heads),
        lower_bound=None,
    )


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
    sublayers = {"attn": layer.self_attn.o_proj, "mlp": layer.mlp.down_proj}
    cross_moments = None
    if stream.dense_inputs is None:
        with run.stage("statistics"), record_inputs(sublayers) as moments:
            dense_outputs = run_layer(layer, stream.inputs, stream.device, stream.store)
        if stream.sequential:
            del dense_outputs  # the next layer must see this one as pruned: recomputed below
    else:
        with run.stage("statistics"), record_stream_pair(sublayers) as recording:
            stream.dense_inputs.batches = run_layer_on_stream_pair(
                layer, stream.inputs, stream.dense_inputs, recording, stream.device, stream.store
            )
        moments, cross_moments = recording.moments, recording.cross_moments
    check_finite_moments(moments, index)

    geometry = attention_geometry(model, layer)
    with run.stage("solver"):
        o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
        q_heads = block_aggregate(interaction_matrix(o_proj.weight, moments["attn"].second_moment), geometry.head_dim)
        check_finite(q_heads, "interaction", "Q of the attention heads", layer.self_attn.layer_idx)
        if isinstance(plan, UniformShape):
            attn = solve_uniform_heads(config.solver, q_heads, geometry, plan, o_proj.weight, moments["attn"])
        else:
            n_heads = plan.layers[index].heads
            attn = solve_sublayer(config.solver, q_heads, n_heads, o_proj.weight, moments["attn"], geometry.head_dim)
        attention_removed = attention_params_removed(layer, geometry, attn.pruned)
        if isinstance(plan, UniformShape):
            n_channels = plan.pruned_channels
        else:
            n_channels = channels_to_prune(plan, index, removed_before, attention_removed)
        q_channels = interaction_matrix(down_proj.weight, moments["mlp"].second_moment)
        check_finite(q_channels, "interaction", "Q of the FFN channels", layer.self_attn.layer_idx)
        mlp = solve_sublayer(config.solver, q_channels, n_channels, down_proj.weight, moments["mlp"], 1)
    del q_heads, q_channels  # not beside the compensation's float64 blocks: each is the FFN width squared
    pruning = LayerPruning(tuple(attn.pruned), tuple(mlp.pruned))
    params_before = sum(sublayer_parameters(layer))
    if config.compensation != "none":
        with run.stage("compensation"):
            attn.compensation, mlp.compensation = compensate_layer(
                layer, geometry, pruning, moments, config.compensation, config.compensation_damping, cross_moments
            )
    del moments, cross_moments
    # Counted after compensation: the mean-bias kind gives o_proj/down_proj biases the dense layer did not have.
    params_kept = sum(sublayer_parameters(layer)) - attention_removed - n_channels * channel_params(layer)
    kv_kept = kept_kv_heads(geometry, pruning.pruned_heads)
    mask_layer(layer, geometry, pruning)
    with run.stage("calibration_forward"):
        if stream.sequential:
            stream.inputs.batches = run_layer(layer, stream.inputs, stream.device, stream.store)
        else:
            stream.inputs.batches = dense_outputs
    layer.to(stream.store)
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
        params_after=params_kept,
    )


def allocate(
    model: PreTrainedModel, windows: torch.Tensor, config: PruneConfig, device: torch.device, run: Run
) -> list[float | None]:
    """Each layer's sensitivity S_l from the cross-entropy gradient (None for all under uniform allocation)."""
    if config.allocation != "gradient":
        return [None] * len(decoder_layers(model))
    run.report("allocation", 0.0, "layer sensitivities from the cross-entropy gradient")
    model.to(device)
    sensitivities = layer_sensitivities(
        model, windows, batch_size=config.calibration.batch_size, device=device, run=run
    )
    model.to("cpu")
    return sensitivities


def prune(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: PruneConfig,
    run: Run | None = None,
    *,
    windows: torch.Tensor | None = None,
    sensitivities: list[float] | None = None,
    release_dense: bool = False,
) -> PruneResult:
    """Prune `model` (masked in place along the way) and return the physically smaller model.

    `windows` are the calibration tokens, read from `config.calibration` when not given; `sensitivities` are
    the gradient allocation's S_l, measured on `model` and `windows` when not given (a bench that prunes one
    dense model many times measures them once). With `release_dense`, `model`'s decoder layers lose their
    weights as the pruned ones are built and verified (a job, which has no use for the masked model after).
    """
    config.validate()
    check_reachable(model, config)
    run = run or Run()
    device = resolve_device(config.device)
    run.time_on(device)
    store = torch.device("cpu")  # calibration activations wait here between layers
    layers = decoder_layers(model)
    calibration = config.calibration
    if windows is None:
        with run.stage("calibration_data"):
            run.report("calibration", 0.0, "loading calibration text")
            windows = calibration_windows(model, tokenizer, config)

    uniform_shape = config.shape == UNIFORM_SHAPE
    gradient = config.allocation == "gradient" and not uniform_shape
    with run.stage("allocation"):
        plan: BudgetPlan | UniformShape
        if uniform_shape:
            # One budget for every layer: no sensitivities are measured (no gradient pass over the model).
            ratios = uniform_ratios(len(layers), config.ratio)
            plan = plan_uniform_shape(model, config)
        else:
            if sensitivities is None:
                sensitivities = allocate(model, windows, config, device, run)
            if gradient:
                ratios = allocate_ratios(sensitivities, config.ratio, config.alpha, config.r_max)
            else:
                ratios = uniform_ratios(len(layers), config.ratio)
            plan = plan_budget(model, ratios, config)

    params_dense = prunable_parameters(model)
    with run.stage("calibration_forward"):
        inputs = capture_first_layer_inputs(model, windows, calibration.batch_size, device, store)
    # Compensating towards the dense model needs its inputs to each layer beside the pruned ones: a second set of
    # parked activations, carried only then (in dense mode the pruned stream is the dense one).
    sequential = calibration.mode == "sequential"
    dense_inputs = None
    if config.compensation == DENSE_TARGET_COMPENSATION and sequential:
        dense_inputs = LayerInputs(list(inputs.batches), inputs.layer_kwargs)
    stream = CalibrationStream(inputs, dense_inputs, sequential, device, store)

    reports: list[LayerReport] = []
    removed = 0
    for index in range(len(layers)):
        run.check_cancelled()
        run.report("pruning", index / len(layers), f"layer {index + 1} of {len(layers)}")
        sensitivity = sensitivities[index] if gradient else None
        report = prune_layer(
            model, index, stream, plan, removed, config, run, ratio=ratios[index], sensitivity=sensitivity
        )
        removed += report.params_before - report.params_after
        reports.append(report)
    run.report("pruning", 1.0, "all layers pruned")
    del stream, inputs, dense_inputs

    prunings = [report.pruning for report in reports]
    with run.stage("surgery"):
        pruned = pruned_skeleton(model, prunings, plain=uniform_shape)
    with run.stage("verification"):
        # Each pruned layer is built just before it is compared, and with `release_dense` the masked layer is freed
        # right after: host memory holds about one copy of the model, not the masked and the pruned side by side.
        run.report("verification", 0.0, "pruned model against the masked model")
        verification = verify(
            model,
            pruned,
            windows[:2, : min(windows.shape[1], 128)],
            device,
            fill_layer=lambda index: fill_pruned_layer(pruned, model, index, prunings[index]),
            release_masked=release_dense,
        )
    return PruneResult(
        model=pruned,
        layers=reports,
        params_dense=params_dense,
        params_pruned=prunable_parameters(pruned),
        verification_max_abs_diff=verification.max_abs_diff,
        verification_max_relative_diff=verification.max_relative_diff,
        timings=run.timer.stages,
    )
