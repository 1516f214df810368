"""One pass over a dense model for many configs: what `prune` would give for each of a sweep's ratios (and the
rounding its exports ask for), with the work they share done once. In dense calibration no layer's statistics depend
on the ratio, so one walk over the layers takes each layer's statistics and Q once and chooses, compensates and masks
every ratio's units on them; in sequential calibration each ratio prunes a copy of its own. The method's steps are
casp_core.method.prune's; this module only shares them.
"""

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.families import family_of
from casp_core.method.budget import rounding_units
from casp_core.method.calibration import (
    LayerInputs,
    SecondMoment,
    check_finite_moments,
    record_inputs,
    run_layer,
)
from casp_core.method.compensation import SharedRefits, shared_refits
from casp_core.method.layer import compensate_and_mask
from casp_core.method.placement import Placement
from casp_core.method.prune import (
    Allocation,
    PrunePlan,
    allocate,
    capture_layer_inputs,
    load_windows,
    measure_sensitivities,
    place,
    prune_as_planned,
    removed_units,
    resident,
)
from casp_core.method.results import LayerReport, PruneResult
from casp_core.method.selection import LayerChoice, LayerQ, choose_units, layer_q
from casp_core.method.surgery import head_columns
from casp_core.method.temperature import restored
from casp_core.model import (
    AttentionGeometry,
    attention_geometry,
    decoder_layers,
    on_device,
    prunable_parameters,
)
from casp_core.run import CPU, Run, StageTimer
from casp_core.settings import MEAN_BIAS_COMPENSATION, PruneConfig


def ratio_config(config: PruneConfig, ratio: float) -> PruneConfig:
    """`config` with `ratio` in place of its own, everything else the same."""
    return config.model_copy(update={"ratio": ratio}, deep=True)


def prune_ratios(
    dense: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: PruneConfig,
    ratios: Sequence[float],
    run: Run | None = None,
    *,
    windows: torch.Tensor | None = None,
    placement: Placement | None = None,
    on_ratio: Callable[[float], None] | None = None,
) -> Iterator[tuple[float, PruneResult]]:
    """`dense` pruned at each of `ratios`, in their order, one result at a time: for each ratio what `prune` of a
    copy of `dense` returns for `config` with that ratio and the same windows. `dense` is left unchanged.
    `on_ratio(ratio)` is called as the work of that ratio alone starts; see `prune_configs` for the rest."""
    configs = [ratio_config(config, ratio) for ratio in ratios]

    def started(index: int) -> None:
        if on_ratio is not None:
            on_ratio(ratios[index])

    results = prune_configs(dense, tokenizer, configs, run, windows=windows, placement=placement, on_start=started)
    return ((ratio_settings.ratio, result) for ratio_settings, result in results)


# What the configs of one `prune_configs` call may differ in: nothing any statistic depends on.
PER_CONFIG_SETTINGS = ("ratio", "export", "gguf_type", "quantization")


def prune_configs(
    dense: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    configs: Sequence[PruneConfig],
    run: Run | None = None,
    *,
    windows: torch.Tensor | None = None,
    placement: Placement | None = None,
    on_start: Callable[[int], None] | None = None,
) -> Iterator[tuple[PruneConfig, PruneResult]]:
    """`dense` pruned with each of `configs`, in their order, one result at a time: for each what `prune` of a copy
    of `dense` returns for it with the same windows. `dense` is left unchanged. The configs may differ only where
    no statistic depends on it: the ratio, and the rounding their exports ask for (a sweep's GGUF types).

    The work every config shares is done once, before the first: the calibration windows, the sensitivities S_l
    and the first decoder layer's inputs. In sequential calibration each config then prunes a copy of `dense` of
    its own (its layers see the layers before them pruned at its ratio). In dense calibration no layer's
    statistics depend on the config: one pass over the layers takes each layer's statistics and Q once and
    chooses, compensates and masks every config's units on them, keeping per config only its masked o_proj and
    down_proj columns; each config's surgery and verification come as its result is asked for.

    `on_start(index)` is called as the work of `configs[index]` alone starts (in dense mode: after the shared layer
    pass, before its surgery). The configs are those a plan admitted (casp_core.job.plan: a sweep's candidates, each
    one's reach checked); one whole units cannot reach is refused as `prune` refuses it, when its budget is planned.
    `run`'s timer counts the shared stages; each result's `timings`, its own config's. Cancelling
    (`run.should_cancel`) stops the sweep at the next layer or config."""
    shared = [{k: v for k, v in config.model_dump().items() if k not in PER_CONFIG_SETTINGS} for config in configs]
    assert all(settings == shared[0] for settings in shared), f"configs differ beyond {PER_CONFIG_SETTINGS}"
    family = family_of(dense.config)
    for config in configs:
        config.validate()
        family.check_settings(dense.config, config)
        family.check_plain_shape(dense.config, config)
    plans = [PrunePlan.of(config, dense.config) for config in configs]
    results = prune_plans(dense, tokenizer, plans, run, windows=windows, placement=placement, on_start=on_start)
    return zip(configs, results, strict=True)


def prune_plans(
    dense: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    plans: Sequence[PrunePlan],
    run: Run | None = None,
    *,
    windows: torch.Tensor | None = None,
    placement: Placement | None = None,
    on_start: Callable[[int], None] | None = None,
) -> Iterator[PruneResult]:
    """`prune_configs` for plans already checked and made (a sweep's, casp_core.job.plan.plan_sweep): they may
    differ in their allocation's ratio and rounding alone."""

    def shared(plan: PrunePlan) -> PrunePlan:
        return replace(plan, allocation=replace(plan.allocation, ratio=0.0, block=None, gguf_type=None))

    assert all(shared(plan) == shared(plans[0]) for plan in plans), "plans differ beyond the ratio and the rounding"
    family_of(dense.config).prepare(dense)
    return _prune_plans(dense, tokenizer, list(plans), run or Run(), windows, placement, on_start)


def _prune_plans(
    dense: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    plans: list[PrunePlan],
    run: Run,
    windows: torch.Tensor | None,
    placement: Placement | None,
    on_start: Callable[[int], None] | None,
) -> Iterator[PruneResult]:
    shared = plans[0]  # for what they share: the plans differ in their allocation's ratio and rounding alone
    placement = place(dense, shared.placement, run, placement)
    if windows is None:
        windows = load_windows(tokenizer, shared.calibration, run)
    runs = [replace(run, timer=StageTimer(run.timer.device)) for _ in plans]
    # In dense mode no layer's statistics depend on the ratio: one pass over the layers serves every ratio.
    dense_mode = not shared.calibration.sequential
    passes: list[RatioPass | None] = []
    with resident(dense, placement):
        sensitivities = None
        if shared.allocation.uses_sensitivities:
            with run.stage("allocation"):
                sensitivities = measure_sensitivities(dense, windows, shared.calibration, placement, run)
        first_layer_inputs = capture_layer_inputs(dense, windows, shared.calibration, placement, run)
        if dense_mode:
            for ratio_plan, ratio_run in zip(plans, runs, strict=True):
                with ratio_run.stage("allocation"):
                    allocation = allocate(dense, windows, ratio_plan, placement, ratio_run, sensitivities)
                passes.append(RatioPass(ratio_plan, ratio_run, allocation))
            prune_layers_for_ratios(dense, first_layer_inputs, passes, placement, run)

    params_dense = prunable_parameters(dense)
    for index, (ratio_plan, ratio_run) in enumerate(zip(plans, runs, strict=True)):
        run.check_cancelled()
        if on_start is not None:
            on_start(index)
        if dense_mode:
            ratio_pass, passes[index] = passes[index], None  # its masked sub-layers go with its result
            result = ratio_pass.finish(dense, windows, placement, params_dense)
        else:
            result = prune_as_planned(
                copy.deepcopy(dense),
                tokenizer,
                ratio_plan,
                ratio_run,
                windows=windows,
                sensitivities=sensitivities,
                first_layer_inputs=first_layer_inputs,
                release_dense=True,  # the copy's masked layers: nobody reads them after verification
                placement=placement,
            )
        yield result


@dataclass
class MaskedLinear:
    """One ratio's o_proj or down_proj of one layer, compensated and masked: its kept input columns (the others
    are zero) and its bias, on the CPU."""

    columns: torch.Tensor  # the kept input columns' numbers
    weight: torch.Tensor  # those columns
    bias: torch.Tensor | None

    @classmethod
    def of(cls, linear: nn.Linear, pruned_columns: list[int]) -> "MaskedLinear":
        weight = linear.weight.detach()
        columns = torch.ones(linear.in_features, dtype=torch.bool)
        columns[pruned_columns] = False
        columns = columns.nonzero().flatten()
        bias = None if linear.bias is None else linear.bias.detach().to(CPU, copy=True)
        return cls(columns, weight.index_select(1, columns.to(weight.device)).to(CPU), bias)

    @torch.no_grad()
    def put_into(self, linear: nn.Linear) -> None:
        """`linear` (a copy of the dense one, sharing its tensors) gets these weights as new tensors of its own."""
        weight = torch.zeros_like(linear.weight, device=CPU).index_copy_(1, self.columns, self.weight)
        linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
        linear.bias = None if self.bias is None else nn.Parameter(self.bias, requires_grad=False)


@dataclass
class RatioPass:
    """One ratio of a dense-mode sweep while the layers are pruned: its allocation, and for each layer done its
    report and its masked o_proj and down_proj (the dense layer itself is left as it was)."""

    plan: PrunePlan
    run: Run
    allocation: Allocation
    reports: list[LayerReport] = field(default_factory=list)
    masked: list[tuple[MaskedLinear, MaskedLinear]] = field(default_factory=list)
    removed: int = 0  # parameters the layers so far lost

    def choose(
        self, layer: nn.Module, geometry: AttentionGeometry, q: LayerQ, moments: dict[str, SecondMoment], index: int
    ) -> LayerChoice:
        """This ratio's units of layer `index`, chosen on its Q."""
        with self.run.stage("solver"):
            return choose_units(
                layer, geometry, q, moments, self.allocation.plan, index, self.removed, self.plan.layer.solver
            )

    def prune_layer(
        self,
        layer: nn.Module,
        geometry: AttentionGeometry,
        choice: LayerChoice,
        moments: dict[str, SecondMoment],
        index: int,
        refits: SharedRefits | None,
    ) -> None:
        """This ratio's `choice` of layer `index`'s units, compensated and masked on a copy of its o_proj and
        down_proj."""
        o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
        with restored(o_proj, down_proj):
            report = compensate_and_mask(
                layer,
                geometry,
                choice,
                moments,
                None,
                self.plan.layer,
                self.run,
                index=index,
                ratio=self.allocation.ratios[index],
                sensitivity=self.allocation.sensitivities[index],
                refits=refits,
            )
            heads = head_columns(geometry, report.pruned_heads)
            self.masked.append((MaskedLinear.of(o_proj, heads), MaskedLinear.of(down_proj, report.pruned_channels)))
        self.removed += report.params_before - report.params_after
        self.reports.append(report)

    def finish(
        self, dense: PreTrainedModel, windows: torch.Tensor, placement: Placement, params_dense: int
    ) -> PruneResult:
        """The masked model (a copy of `dense` that shares every weight but the masked ones), then surgery and
        verification as `prune` ends."""
        masked = copy.deepcopy(dense, {id(tensor): tensor for tensor in [*dense.parameters(), *dense.buffers()]})
        for layer, (o_proj, down_proj) in zip(decoder_layers(masked), self.masked, strict=True):
            o_proj.put_into(layer.self_attn.o_proj)
            down_proj.put_into(layer.mlp.down_proj)
        self.masked.clear()
        return removed_units(
            masked,
            self.reports,
            self.allocation.temperature,
            self.plan.allocation.uniform_shape,
            windows,
            placement,
            self.run,
            params_dense,
            rounding_units(dense, self.plan.allocation),
            release_masked=False,  # its other weights are the dense model's
        )


def prune_layers_for_ratios(
    dense: PreTrainedModel,
    first_layer_inputs: LayerInputs,
    passes: list[RatioPass],
    placement: Placement,
    run: Run,
) -> None:
    """Dense mode, every ratio at once: each layer's statistics and Q once, from the dense model's activations,
    then each ratio's units chosen on them. `dense` is left as it was."""
    inputs = replace(first_layer_inputs, batches=list(first_layer_inputs.batches))
    layers = decoder_layers(dense)
    shared = passes[0].plan.layer  # the ratios differ in nothing the compensation reads
    for index, layer in enumerate(layers):
        run.check_cancelled()
        run.report("pruning", index / len(layers), f"layer {index + 1} of {len(layers)}, {len(passes)} ratios")
        with on_device(layer, placement.device, placement.home):
            sublayers = {"attn": layer.self_attn.o_proj, "mlp": layer.mlp.down_proj}
            with run.stage("statistics"), record_inputs(sublayers) as moments:
                outputs = run_layer(layer, inputs, placement.device, CPU)
            check_finite_moments(moments, index)
            geometry = attention_geometry(dense, layer)
            with run.stage("statistics"):
                q = layer_q(layer, geometry, moments)
            choices = [ratio_pass.choose(layer, geometry, q, moments, index) for ratio_pass in passes]
            refits = None
            if shared.compensation not in ("none", MEAN_BIAS_COMPENSATION):
                # One factor of each sub-layer's C serves every ratio whose pruned set nests in the others'.
                with run.stage("compensation"):
                    pruned = [choice.pruning for choice in choices]
                    refits = shared_refits(layer, geometry, pruned, moments, shared.compensation_damping)
            for ratio_pass, choice in zip(passes, choices, strict=True):
                ratio_pass.prune_layer(layer, geometry, choice, moments, index, refits)
            del moments, q, choices, refits
        inputs.batches = outputs
    run.report("pruning", 1.0, "all layers pruned")
