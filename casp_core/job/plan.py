"""A job's settings checked against the model's config once, before any weight loads: the API's pre-flight, the
command line's and the job's own are each one call to `plan_job`, so all three refuse the same settings with the
same message.

What it checks needs the settings and the model's config alone (a model of that config is built on the meta
device, without weights): that the family takes the settings (casp_core.families: the export, the settings a
family is not pruned with, a uniform shape its own class cannot hold), that whole heads and channels within r_max
reach the ratio (casp_core.method.budget, at the rounding the export asks for), that the widths take the
quantization (casp_core.artifacts.compressed_tensors.quantize), that recovery's windows fit the model's context,
and for a budget that some candidate meets it by the sizes estimated from the config. The `JobPlan` it returns
holds the typed piece each stage reads: a single ratio's prune (casp_core.method.prune.PrunePlan: calibration,
placement, allocation, the layer step) or a target's sweep, the evaluation (casp_core.eval.evaluate.EvaluationPlan,
whose texts are read once the tokenizer loads), recovery (casp_core.recovery.data.RecoveryPlan) and the artifacts
(`ArtifactsPlan`). `run_job` plans before any weight loads, and so does each retry.

Checked where they run, because they need more than the config:
- the tokenizer llama.cpp must reproduce for a GGUF export, and the rounding's warnings (casp_core.job.steps,
  once the weights are loaded);
- the device's memory, for pruning and for recovery (casp_core.method.placement);
- a GGUF source's header (casp_core.artifacts.gguf.source, when the file is read) and the data sets' presence.
"""

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

from casp_core.artifacts.compressed_tensors.quantize import check_quantization
from casp_core.errors import InvalidConfig
from casp_core.eval.evaluate import EvaluationPlan
from casp_core.families import check_export, family_of
from casp_core.job.stages import Stage, job_stages
from casp_core.job.sweep.candidates import (
    DEFAULT_GGUF_TYPES,
    DEFAULT_QUANTIZATIONS,
    GGUF,
    Candidate,
    Estimator,
    nothing_fits,
    sweep_format,
    within_target,
)
from casp_core.job.sweep.shapes import meta_model
from casp_core.method.budget import AllocationPlan, check_reachable
from casp_core.method.calibration import CalibrationPlan
from casp_core.method.placement import PlacementPlan
from casp_core.method.prune import PrunePlan
from casp_core.recovery.data import RecoveryPlan
from casp_core.report.publish import without_local_paths
from casp_core.settings import NO_QUANTIZATION, PruneConfig, PruneSettings


@dataclass(frozen=True)
class SweepPlan:
    """A budget's sweep: the format it writes, the candidates that fit the budget by the sizes estimated from the
    config, the dense model in each variant of the format the model takes (ratio 0.0: the curve's reference
    points, measured whatever their size), each candidate's prune, and what they all share: the calibration and
    the placement."""

    format: str  # "gguf" | "safetensors"
    candidates: tuple[Candidate, ...]  # by ratio, then variant as given
    dense_points: tuple[Candidate, ...]
    calibration: CalibrationPlan
    placement: PlacementPlan
    prunes: dict[tuple[float, str], PrunePlan]  # by a candidate's (ratio, variant)

    def prune_of(self, ratio: float, variant: str) -> PrunePlan:
        """The prune of the candidate at `ratio` in `variant`: its allocation rounds as the variant asks."""
        return self.prunes[(ratio, variant)]

    @property
    def variants(self) -> tuple[str, ...]:
        """The GGUF types or quantization schemes, in the order given."""
        return tuple(point.variant for point in self.dense_points)


@dataclass(frozen=True)
class ArtifactsPlan:
    """What a job writes beside the checkpoint, and what the checkpoint records of the settings it was made with."""

    recorded_settings: dict[str, Any]  # the settings as the checkpoint's config records them, without local paths
    export: tuple[str, ...]  # "gguf" and/or "safetensors"
    gguf_type: str
    quantization: str | None  # the compressed-tensors scheme; None: no quantized checkpoint

    @classmethod
    def of(cls, settings: PruneSettings) -> "ArtifactsPlan":
        quantization = None if settings.quantization == NO_QUANTIZATION else settings.quantization
        return cls(without_local_paths(settings.to_dict()), tuple(settings.export), settings.gguf_type, quantization)


@dataclass(frozen=True)
class JobPlan:
    """What the job runs from: the settings checked, and the typed pieces its stages read."""

    settings: PruneConfig  # what the report records
    stages: tuple[Stage, ...]  # what the job will report, in order
    prune: PrunePlan | None  # a single ratio's: its calibration, placement, allocation and layer step; None for a sweep
    sweep: SweepPlan | None  # a budget's; None for a single ratio
    evaluation: EvaluationPlan  # of the dense model, the pruned one and the one published (texts read at load)
    recovery: RecoveryPlan | None  # None: the job does not recover
    artifacts: ArtifactsPlan  # a single ratio's; a sweep's pick writes as its candidate's settings say


def plan_job(settings: PruneConfig, model_config: PretrainedConfig) -> JobPlan:
    """The job `settings` asks for on a model of `model_config`, or the first refusal (InvalidConfig, whose message
    names the setting first; UnsupportedModel or UnsupportedExport for the model). The reach is checked on a model
    of `model_config` built on the meta device."""
    settings.validate()
    family = family_of(model_config)
    check_export(model_config, settings.export)
    family.check_settings(model_config, settings)
    family.check_plain_shape(model_config, settings)
    check_quantization(model_config, settings)
    recovery = RecoveryPlan.of(settings, model_config) if settings.recovery.enabled else None
    evaluation, artifacts = EvaluationPlan.of(settings, model_config), ArtifactsPlan.of(settings)
    if settings.is_sweep:
        sweep = plan_sweep(model_config, settings)
        return JobPlan(settings, job_stages(settings), None, sweep, evaluation, recovery, artifacts)
    prune = PrunePlan.of(settings, model_config)
    check_reachable(meta_model(model_config), prune.allocation)
    return JobPlan(settings, job_stages(settings), prune, None, evaluation, recovery, artifacts)


def plan_sweep(model_config: PretrainedConfig, settings: PruneConfig) -> SweepPlan:
    """The sweep of a job with a target: every (ratio, variant) whole units reach, ordered by ratio then variant,
    without those a bytes or parameters budget excludes by estimate; InvalidConfig naming the budget and the
    smallest size reachable when none is left."""
    assert settings.target is not None, "only a job with a target sweeps"
    estimator, fmt = Estimator(model_config, settings), sweep_format(settings)
    variants = sweep_variants(model_config, settings)
    prunes = {
        (ratio, variant): PrunePlan.of(settings.candidate_config(ratio, fmt, variant), model_config)
        for ratio in sorted(settings.ratios)
        for variant in variants
    }
    candidates = [
        estimator.candidate(ratio, fmt, variant, prune)
        for (ratio, variant), prune in prunes.items()
        if _reaches(estimator.model, prune.allocation)
    ]
    if not candidates:
        raise InvalidConfig(
            f"ratios: whole heads and FFN channels within r_max = {settings.r_max} reach none of "
            f"{', '.join(map(str, sorted(settings.ratios)))} on this model (ask for less, or raise r_max)"
        )
    fitting = [c for c in candidates if within_target(c.estimated_bytes, c.estimated_params, settings.target)]
    if not fitting:
        raise InvalidConfig(nothing_fits(candidates, settings.target))
    dense = tuple(estimator.candidate(0.0, fmt, variant, None) for variant in variants)
    calibration, placement = CalibrationPlan.of(settings, model_config), PlacementPlan.of(settings, model_config)
    fitting_prunes = {(c.ratio, c.variant): prunes[(c.ratio, c.variant)] for c in fitting}
    return SweepPlan(fmt, tuple(fitting), dense, calibration, placement, fitting_prunes)


def _reaches(model: PreTrainedModel, allocation: AllocationPlan) -> bool:
    """Whether whole units within r_max reach the allocation's ratio under the rounding it asks for."""
    try:
        check_reachable(model, allocation)
    except InvalidConfig:
        return False
    return True


def sweep_variants(model_config: PretrainedConfig, settings: PruneSettings) -> list[str]:
    """The variants of the sweep's format: the ones asked for, each checked against the model; by default those of
    the defaults the model's widths take (every GGUF type: llama.cpp quantizes any width, with its fallbacks)."""
    if sweep_format(settings) == GGUF:
        check_export(model_config, [GGUF])
        return list(settings.gguf_types or DEFAULT_GGUF_TYPES)
    if settings.quantizations is None:
        return [scheme for scheme in DEFAULT_QUANTIZATIONS if _refusal(model_config, settings, scheme) is None]
    for scheme in settings.quantizations:
        if (refused := _refusal(model_config, settings, scheme)) is not None:
            raise InvalidConfig(f"quantizations: {refused}")
    return list(settings.quantizations)


def _refusal(model_config: PretrainedConfig, settings: PruneSettings, scheme: str) -> str | None:
    """Why this model's widths cannot take the compressed-tensors `scheme`, or None."""
    try:
        check_quantization(model_config, settings.model_copy(update={"quantization": scheme}))
    except InvalidConfig as refused:
        return refused.message.partition(": ")[2] or refused.message
    return None
