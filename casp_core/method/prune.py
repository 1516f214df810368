"""Pruning a loaded model: allocate the ratio over layers, then layer by layer measure, choose, compensate, mask;
at the end remove the masked units and verify that the smaller model computes what the masked one computes.

`casp_core.method.layer.prune_layer` is one layer of the paper's loop (statistics -> Q -> solver -> compensation
-> mask), `casp_core.method.experts.prune_moe_layer` a mixture of experts' layer; `prune` is the loop, with the
allocation before it and surgery and verification after it.
"""

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from casp_core.families import family_of
from casp_core.method.allocation import allocate_ratios, layer_sensitivities, uniform_ratios
from casp_core.method.budget import (
    AllocationPlan,
    BudgetPlan,
    UniformShape,
    plan_budget,
    plan_uniform_shape,
    rounding_units,
)
from casp_core.method.calibration import (
    CalibrationPlan,
    CalibrationStream,
    LayerInputs,
    calibration_windows,
    capture_first_layer_inputs,
)
from casp_core.method.experts import ExpertsPlan, prune_moe_layer
from casp_core.method.layer import LayerPlan, prune_layer
from casp_core.method.placement import RESIDENT, Placement, PlacementPlan, choose_placement
from casp_core.method.results import LayerReport, PruneResult, TemperatureChoice
from casp_core.method.surgery import fill_pruned_layer, pruned_skeleton
from casp_core.method.temperature import choose_alpha
from casp_core.method.verification import verify
from casp_core.model import (
    decoder_layers,
    on_device,
    prunable_parameters,
    resolve_device,
)
from casp_core.run import CPU, Run
from casp_core.settings import DENSE_TARGET_COMPENSATION, PruneConfig


@dataclass(frozen=True)
class PrunePlan:
    """The settings of a prune, one typed piece per stage: the calibration, where the weights are, the allocation,
    each layer's step and a mixture of experts' own. casp_core.job.plan builds it once for a job; `prune` builds it
    for a caller who did not."""

    calibration: CalibrationPlan
    placement: PlacementPlan
    allocation: AllocationPlan
    layer: LayerPlan
    experts: ExpertsPlan  # read by a mixture of experts' layers alone

    @classmethod
    def of(cls, settings: PruneConfig, model_config: PretrainedConfig) -> "PrunePlan":
        """The plan of single-ratio `settings` on a model of `model_config`."""
        return cls(
            CalibrationPlan.of(settings, model_config),
            PlacementPlan.of(settings, model_config),
            AllocationPlan.of(settings),
            LayerPlan.of(settings),
            ExpertsPlan.of(settings),
        )


@dataclass
class Allocation:
    """The allocation stage's outcome: each layer's ratio and budget, and what the report says of how."""

    ratios: list[float]
    plan: BudgetPlan | UniformShape
    sensitivities: list[float | None]  # S_l per layer; None where they were not measured or not used
    temperature: TemperatureChoice | None  # alpha "auto" only


def measure_sensitivities(
    model: PreTrainedModel, windows: torch.Tensor, calibration: CalibrationPlan, placement: Placement, run: Run
) -> list[float]:
    run.report("allocation", 0.0, "layer sensitivities from the cross-entropy gradient")
    return layer_sensitivities(
        model,
        windows,
        batch_size=calibration.batch_size,
        device=placement.device,
        run=run,
        home=placement.home,
    )


def allocate(
    model: PreTrainedModel,
    windows: torch.Tensor,
    plan: PrunePlan,
    placement: Placement,
    run: Run,
    sensitivities: list[float] | None,
) -> Allocation:
    """Layer ratios from the gradient sensitivities S_l (measured unless given) at the plan's alpha (or the
    temperature alpha "auto" picks), or uniform; then each layer's budget. The uniform shape measures nothing: one
    budget for every layer."""
    n_layers, allocation = len(decoder_layers(model)), plan.allocation
    if allocation.uniform_shape:
        return Allocation(
            uniform_ratios(n_layers, allocation.ratio),
            plan_uniform_shape(model, allocation),
            [None] * n_layers,
            None,
        )
    if not allocation.uses_sensitivities:
        ratios = uniform_ratios(n_layers, allocation.ratio)
        return Allocation(ratios, plan_budget(model, ratios, allocation), [None] * n_layers, None)
    if sensitivities is None:
        sensitivities = measure_sensitivities(model, windows, plan.calibration, placement, run)
    alpha, temperature = allocation.alpha, None
    if allocation.alpha_auto:
        temperature = choose_alpha(
            model,
            windows,
            sensitivities,
            allocation,
            plan.layer,
            plan.calibration.batch_size,
            placement.device,
            run,
            CPU,
            placement.home,
        )
        # A stage of its own, so that the worker keeps the choice as an event of the job.
        run.report("temperature", 1.0, temperature.message())
        alpha = temperature.alpha
    ratios = allocate_ratios(sensitivities, allocation.ratio, float(alpha), allocation.r_max)
    return Allocation(ratios, plan_budget(model, ratios, allocation), list(sensitivities), temperature)


def prune_layers(
    model: PreTrainedModel,
    windows: torch.Tensor,
    allocation: Allocation,
    plan: PrunePlan,
    placement: Placement,
    run: Run,
    first_layer_inputs: LayerInputs | None = None,
) -> list[LayerReport]:
    """Every layer in turn, the calibration activations carried from one to the next (on the CPU between them),
    from `first_layer_inputs` when given (they are not changed: the stream carries its own list of batches)."""
    if first_layer_inputs is None:
        inputs = capture_layer_inputs(model, windows, plan.calibration, placement, run)
    else:
        # The caller's are left as they are: the stream carries its own list of batches. Ours are not kept beside
        # it, as each batch is let go when the stream moves on (at 128 x 2048 tokens of a 576-wide model in float32
        # they are 0.6 GB, held to the end when a second list kept them).
        inputs = replace(first_layer_inputs, batches=list(first_layer_inputs.batches))
    # Compensating towards the dense model needs its inputs to each layer beside the pruned ones: a second set of
    # parked activations, carried only then (in dense mode the pruned stream is the dense one).
    sequential = plan.calibration.sequential
    dense_inputs = None
    if plan.layer.compensation == DENSE_TARGET_COMPENSATION and sequential:
        dense_inputs = replace(inputs, batches=list(inputs.batches))
    stream = CalibrationStream(inputs, dense_inputs, sequential, placement.device, CPU, placement.home)
    n_layers = len(decoder_layers(model))
    reports: list[LayerReport] = []
    removed = 0
    has_experts = family_of(model.config).has_experts
    for index in range(n_layers):
        run.check_cancelled()
        run.report("pruning", index / n_layers, f"layer {index + 1} of {n_layers}")
        ratio, sensitivity = allocation.ratios[index], allocation.sensitivities[index]
        if has_experts:
            report = prune_moe_layer(
                model,
                index,
                stream,
                allocation.plan,
                removed,
                plan.layer,
                plan.experts,
                run,
                ratio=ratio,
                sensitivity=sensitivity,
            )
        else:
            report = prune_layer(
                model, index, stream, allocation.plan, removed, plan.layer, run, ratio=ratio, sensitivity=sensitivity
            )
        removed += report.params_before - report.params_after
        reports.append(report)
    run.report("pruning", 1.0, "all layers pruned")
    return reports


def capture_layer_inputs(
    model: PreTrainedModel, windows: torch.Tensor, calibration: CalibrationPlan, placement: Placement, run: Run
) -> LayerInputs:
    """The first decoder layer's inputs for `windows`, on the CPU, as the layer loop starts from them."""
    with run.stage("calibration_forward"):
        return capture_first_layer_inputs(model, windows, calibration.batch_size, placement.device, CPU, placement.home)


def place(model: PreTrainedModel, plan: PlacementPlan, run: Run, placement: Placement | None) -> Placement:
    """`placement`, or `choose_placement`'s; reported, and the run's stages timed on its device."""
    placement = placement or choose_placement(model, plan, resolve_device(plan.device))
    run.report("placement", 1.0, placement.message())
    run.time_on(placement.device)
    return placement


def resident(model: PreTrainedModel, placement: Placement) -> AbstractContextManager[None]:
    """The whole model on the device while the layers are pruned when the placement is resident, else nothing."""
    return on_device(model, placement.device, CPU) if placement.mode == RESIDENT else nullcontext()


def load_windows(tokenizer: PreTrainedTokenizerBase, calibration: CalibrationPlan, run: Run) -> torch.Tensor:
    with run.stage("calibration_data"):
        run.report("calibration", 0.0, "loading calibration text")
        return calibration_windows(tokenizer, calibration)


def prune(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: PruneConfig,
    run: Run | None = None,
    *,
    windows: torch.Tensor | None = None,
    sensitivities: list[float] | None = None,
    first_layer_inputs: LayerInputs | None = None,
    release_dense: bool = False,
    placement: Placement | None = None,
) -> PruneResult:
    """Prune `model` (masked in place along the way) and return the physically smaller model.

    `windows` are the calibration tokens, read as `config.calibration` says when not given; `sensitivities` are
    the gradient allocation's S_l, measured on `model` and `windows` when not given (a bench that prunes one
    dense model many times measures them once); `first_layer_inputs` likewise, `windows` entering the first
    decoder layer (`capture_layer_inputs`, on the same model and placement). With `release_dense`, `model`'s
    decoder layers lose their weights as the pruned ones are built and verified (a job, which has no use for the
    masked model after).

    `placement` (`choose_placement`'s when not given) says where the weights are while layers are pruned: resident,
    the model goes to the device once before the allocation and comes back once after the last layer (or an
    error); offloaded, one decoder layer (or the embedding, or the final norm and head) is there at a time. Surgery
    and verification start from the CPU either way (verification copies one layer of each model at a time), and
    both the masked and the pruned model are returned there.

    A job's settings were checked against the model before any work (casp_core.job.plan.plan_job, for the API, the
    command line and the job alike), and its plan's `prune` goes to `prune_as_planned`. Called directly, `prune`
    checks what a family refuses, and refuses a ratio whole heads and channels cannot reach when it plans the
    budget (InvalidConfig, plan_job's message).
    """
    config.validate()
    family = family_of(model.config)
    family.check_settings(model.config, config)
    family.check_plain_shape(model.config, config)
    return prune_as_planned(
        model,
        tokenizer,
        PrunePlan.of(config, model.config),
        run,
        windows=windows,
        sensitivities=sensitivities,
        first_layer_inputs=first_layer_inputs,
        release_dense=release_dense,
        placement=placement,
    )


def prune_as_planned(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    plan: PrunePlan,
    run: Run | None = None,
    *,
    windows: torch.Tensor | None = None,
    sensitivities: list[float] | None = None,
    first_layer_inputs: LayerInputs | None = None,
    release_dense: bool = False,
    placement: Placement | None = None,
) -> PruneResult:
    """`prune`, with settings already checked and planned (casp_core.job.plan); the arguments as `prune`'s."""
    family_of(model.config).prepare(model)
    run = run or Run()
    placement = place(model, plan.placement, run, placement)
    if windows is None:
        windows = load_windows(tokenizer, plan.calibration, run)

    params_dense = prunable_parameters(model)
    rounding = rounding_units(model, plan.allocation)
    with resident(model, placement):
        with run.stage("allocation"):
            allocation = allocate(model, windows, plan, placement, run, sensitivities)
        reports = prune_layers(model, windows, allocation, plan, placement, run, first_layer_inputs)

    return removed_units(
        model,
        reports,
        allocation.temperature,
        plan.allocation.uniform_shape,
        windows,
        placement,
        run,
        params_dense,
        rounding,
        release_dense,
    )


def removed_units(
    masked: PreTrainedModel,
    reports: list[LayerReport],
    temperature: TemperatureChoice | None,
    plain: bool,
    windows: torch.Tensor,
    placement: Placement,
    run: Run,
    params_dense: int,
    rounding: dict[str, Any],
    release_masked: bool,
) -> PruneResult:
    """Surgery and verification: the physically smaller model built from `masked` (its units masked as `reports`
    say; `plain`: every layer alike, the uniform shape) and checked to compute what `masked` computes; the result as
    `prune` returns it."""
    prunings = [report.pruning for report in reports]
    with run.stage("surgery"):
        pruned = pruned_skeleton(masked, prunings, plain=plain)
    with run.stage("verification"):
        # Each pruned layer is built just before it is compared, and with `release_masked` the masked layer is
        # freed right after: host memory holds about one copy of the model, not the masked and the pruned side by
        # side.
        run.report("verification", 0.0, "pruned model against the masked model")
        verification = verify(
            masked,
            pruned,
            windows[:2, : min(windows.shape[1], 128)],
            placement.device,
            fill_layer=lambda index: fill_pruned_layer(pruned, masked, index, prunings[index]),
            release_masked=release_masked,
        )
    return PruneResult(
        model=pruned,
        layers=reports,
        params_dense=params_dense,
        params_pruned=prunable_parameters(pruned),
        verification_max_abs_diff=verification.max_abs_diff,
        verification_max_relative_diff=verification.max_relative_diff,
        timings=run.timer.stages,
        temperature=temperature,
        placement=placement,
        rounding=rounding,
    )
