"""Pruning a loaded model: allocate the ratio over layers, then layer by layer measure, choose, compensate, mask;
at the end remove the masked units and verify that the smaller model computes what the masked one computes.

`casp_core.method.layer.prune_layer` is one layer of the paper's loop (statistics -> Q -> solver -> compensation
-> mask); `prune` is the loop, with the allocation before it and surgery and verification after it.
"""

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.families import family_of
from casp_core.method.allocation import allocate_ratios, layer_sensitivities, uniform_ratios
from casp_core.method.budget import (
    BudgetPlan,
    UniformShape,
    plan_budget,
    plan_uniform_shape,
    rounding_units,
)
from casp_core.method.calibration import (
    CalibrationStream,
    LayerInputs,
    calibration_windows,
    capture_first_layer_inputs,
)
from casp_core.method.layer import prune_layer
from casp_core.method.placement import RESIDENT, Placement, choose_placement
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
from casp_core.settings import AUTO_ALPHA, DENSE_TARGET_COMPENSATION, UNIFORM_SHAPE, PruneConfig


@dataclass
class Allocation:
    """The allocation stage's outcome: each layer's ratio and budget, and what the report says of how."""

    ratios: list[float]
    plan: BudgetPlan | UniformShape
    sensitivities: list[float | None]  # S_l per layer; None where they were not measured or not used
    temperature: TemperatureChoice | None  # alpha "auto" only


def uses_sensitivities(config: PruneConfig) -> bool:
    """Whether the allocation reads the gradient sensitivities S_l (the uniform shape and allocation do not)."""
    return config.shape != UNIFORM_SHAPE and config.allocation == "gradient"


def measure_sensitivities(
    model: PreTrainedModel, windows: torch.Tensor, config: PruneConfig, placement: Placement, run: Run
) -> list[float]:
    run.report("allocation", 0.0, "layer sensitivities from the cross-entropy gradient")
    return layer_sensitivities(
        model,
        windows,
        batch_size=config.calibration.batch_size,
        device=placement.device,
        run=run,
        home=placement.home,
    )


def allocate(
    model: PreTrainedModel,
    windows: torch.Tensor,
    config: PruneConfig,
    placement: Placement,
    run: Run,
    sensitivities: list[float] | None,
) -> Allocation:
    """Layer ratios from the gradient sensitivities S_l (measured unless given) at `config.alpha` (or the
    temperature alpha "auto" picks), or uniform; then each layer's budget. The uniform shape measures nothing: one
    budget for every layer."""
    n_layers = len(decoder_layers(model))
    if config.shape == UNIFORM_SHAPE:
        return Allocation(
            uniform_ratios(n_layers, config.ratio), plan_uniform_shape(model, config), [None] * n_layers, None
        )
    if not uses_sensitivities(config):
        ratios = uniform_ratios(n_layers, config.ratio)
        return Allocation(ratios, plan_budget(model, ratios, config), [None] * n_layers, None)
    if sensitivities is None:
        sensitivities = measure_sensitivities(model, windows, config, placement, run)
    alpha, temperature = config.alpha, None
    if alpha == AUTO_ALPHA:
        temperature = choose_alpha(model, windows, sensitivities, config, placement.device, run, CPU, placement.home)
        # A stage of its own, so that the worker keeps the choice as an event of the job.
        run.report("temperature", 1.0, temperature.message())
        alpha = temperature.alpha
    ratios = allocate_ratios(sensitivities, config.ratio, alpha, config.r_max)
    return Allocation(ratios, plan_budget(model, ratios, config), list(sensitivities), temperature)


def prune_layers(
    model: PreTrainedModel,
    windows: torch.Tensor,
    allocation: Allocation,
    config: PruneConfig,
    placement: Placement,
    run: Run,
    first_layer_inputs: LayerInputs | None = None,
) -> list[LayerReport]:
    """Every layer in turn, the calibration activations carried from one to the next (on the CPU between them),
    from `first_layer_inputs` when given (they are not changed: the stream carries its own list of batches)."""
    calibration = config.calibration
    if first_layer_inputs is None:
        inputs = capture_layer_inputs(model, windows, config, placement, run)
    else:
        # The caller's are left as they are: the stream carries its own list of batches. Ours are not kept beside
        # it, as each batch is let go when the stream moves on (at 128 x 2048 tokens of a 576-wide model in float32
        # they are 0.6 GB, held to the end when a second list kept them).
        inputs = replace(first_layer_inputs, batches=list(first_layer_inputs.batches))
    # Compensating towards the dense model needs its inputs to each layer beside the pruned ones: a second set of
    # parked activations, carried only then (in dense mode the pruned stream is the dense one).
    sequential = calibration.mode == "sequential"
    dense_inputs = None
    if config.compensation == DENSE_TARGET_COMPENSATION and sequential:
        dense_inputs = replace(inputs, batches=list(inputs.batches))
    stream = CalibrationStream(inputs, dense_inputs, sequential, placement.device, CPU, placement.home)
    n_layers = len(decoder_layers(model))
    reports: list[LayerReport] = []
    removed = 0
    for index in range(n_layers):
        run.check_cancelled()
        run.report("pruning", index / n_layers, f"layer {index + 1} of {n_layers}")
        report = prune_layer(
            model,
            index,
            stream,
            allocation.plan,
            removed,
            config,
            run,
            ratio=allocation.ratios[index],
            sensitivity=allocation.sensitivities[index],
        )
        removed += report.params_before - report.params_after
        reports.append(report)
    run.report("pruning", 1.0, "all layers pruned")
    return reports


def capture_layer_inputs(
    model: PreTrainedModel, windows: torch.Tensor, config: PruneConfig, placement: Placement, run: Run
) -> LayerInputs:
    """The first decoder layer's inputs for `windows`, on the CPU, as the layer loop starts from them."""
    with run.stage("calibration_forward"):
        return capture_first_layer_inputs(
            model, windows, config.calibration.batch_size, placement.device, CPU, placement.home
        )


def place(model: PreTrainedModel, config: PruneConfig, run: Run, placement: Placement | None) -> Placement:
    """`placement`, or `choose_placement`'s; reported, and the run's stages timed on its device."""
    placement = placement or choose_placement(model, config, resolve_device(config.device))
    run.report("placement", 1.0, placement.message())
    run.time_on(placement.device)
    return placement


def resident(model: PreTrainedModel, placement: Placement) -> AbstractContextManager[None]:
    """The whole model on the device while the layers are pruned when the placement is resident, else nothing."""
    return on_device(model, placement.device, CPU) if placement.mode == RESIDENT else nullcontext()


def load_windows(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: PruneConfig, run: Run
) -> torch.Tensor:
    with run.stage("calibration_data"):
        run.report("calibration", 0.0, "loading calibration text")
        return calibration_windows(model, tokenizer, config)


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

    `windows` are the calibration tokens, read from `config.calibration` when not given; `sensitivities` are
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
    command line and the job alike). Called directly, `prune` checks what a family refuses, and refuses a ratio
    whole heads and channels cannot reach when it plans the budget (InvalidConfig, plan_job's message).
    """
    config.validate()
    family = family_of(model.config)
    family.check_settings(model.config, config)
    family.prepare(model)
    run = run or Run()
    placement = place(model, config, run, placement)
    if windows is None:
        windows = load_windows(model, tokenizer, config, run)

    params_dense = prunable_parameters(model)
    rounding = rounding_units(model, config)
    with resident(model, placement):
        with run.stage("allocation"):
            allocation = allocate(model, windows, config, placement, run, sensitivities)
        reports = prune_layers(model, windows, allocation, config, placement, run, first_layer_inputs)

    return removed_units(
        model, reports, allocation.temperature, config, windows, placement, run, params_dense, rounding, release_dense
    )


def removed_units(
    masked: PreTrainedModel,
    reports: list[LayerReport],
    temperature: TemperatureChoice | None,
    config: PruneConfig,
    windows: torch.Tensor,
    placement: Placement,
    run: Run,
    params_dense: int,
    rounding: dict[str, Any],
    release_masked: bool,
) -> PruneResult:
    """Surgery and verification: the physically smaller model built from `masked` (its units masked as `reports`
    say) and checked to compute what `masked` computes; the result as `prune` returns it."""
    prunings = [report.pruning for report in reports]
    with run.stage("surgery"):
        pruned = pruned_skeleton(masked, prunings, plain=config.shape == UNIFORM_SHAPE)
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
