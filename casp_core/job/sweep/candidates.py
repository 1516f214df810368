"""A budget as candidates: the (ratio, format variant) pairs a sweep tries, with their sizes estimated from the
dense model's config before any statistics (casp_core.job.sweep.shapes).

A job with `target` prunes at each of `ratios` and writes each pruned model in each variant of the sweep's format:
GGUF types (`gguf_types`) or compressed-tensors schemes for safetensors (`quantizations`). A bytes or parameters
budget leaves out, before any work, the candidates whose estimate exceeds it; none left is refused, naming the
smallest size reachable. The dense model in each variant is a reference point of the curve.
"""

from dataclasses import dataclass

from transformers import PretrainedConfig

from casp_core.artifacts.compressed_tensors.quantize import check_quantization
from casp_core.artifacts.compressed_tensors.size import safetensors_bytes
from casp_core.artifacts.gguf.size import gguf_bytes
from casp_core.artifacts.shapes import Geometry
from casp_core.errors import InvalidConfig
from casp_core.families import check_export
from casp_core.job.sweep.shapes import meta_model, planned_shape
from casp_core.method.budget import check_reachable
from casp_core.settings import PruneConfig, PruneSettings, TargetConfig

GGUF = "gguf"
SAFETENSORS = "safetensors"
DEFAULT_GGUF_TYPES = ("f16", "q8_0", "q5_k_m", "q4_k_m")
DEFAULT_QUANTIZATIONS = ("none", "w8a8_int8", "w4a16")


@dataclass(frozen=True)
class Candidate:
    ratio: float  # 0.0 for the dense reference points
    format: str  # "gguf" | "safetensors"
    variant: str  # the GGUF type ("q4_k_m") or the quantization scheme ("none", "w8a8_int8", ...)
    estimated_bytes: int  # of the file(s) a user serves in that format
    estimated_params: int  # every parameter the model holds (embedding and head included, tied ones once)


def sweep_format(settings: PruneSettings) -> str:
    """What the sweep writes: the bytes budget's format; for the other budgets, GGUF when the job exports it."""
    assert settings.target is not None, "only a job with a target sweeps"
    if settings.target.max_bytes is not None:
        return settings.target.format or GGUF
    return GGUF if settings.exports_gguf else SAFETENSORS


def sweep_variants(model_config: PretrainedConfig, settings: PruneSettings) -> list[str]:
    """The variants of the sweep's format: the ones asked for, each checked against the model; by default those of
    the defaults the model's widths take (every GGUF type: llama.cpp quantizes any width, with its fallbacks)."""
    if sweep_format(settings) == GGUF:
        check_export(model_config, [GGUF])
        return _variants(model_config, settings, "gguf_types", settings.gguf_types, DEFAULT_GGUF_TYPES)
    return _variants(model_config, settings, "quantizations", settings.quantizations, DEFAULT_QUANTIZATIONS)


def _variants(
    model_config: PretrainedConfig,
    settings: PruneSettings,
    name: str,
    asked: list[str] | None,
    default: tuple[str, ...],
) -> list[str]:
    if asked is None:
        return [variant for variant in default if _refusal(model_config, settings, name, variant) is None]
    for variant in asked:
        if (refused := _refusal(model_config, settings, name, variant)) is not None:
            raise InvalidConfig(f"{name}: {refused}")
    return list(asked)


def _refusal(model_config: PretrainedConfig, settings: PruneSettings, name: str, variant: str) -> str | None:
    """Why this model cannot be written in `variant`, or None."""
    if name == "gguf_types":
        return None
    try:
        check_quantization(model_config, settings.model_copy(update={"quantization": variant}))
    except InvalidConfig as refused:
        return refused.message.partition(": ")[2] or refused.message
    return None


class Estimator:
    """Sizes of a model's candidates, from its config and a meta model (casp_core.job.sweep.shapes)."""

    def __init__(self, model_config: PretrainedConfig, settings: PruneSettings) -> None:
        self.model = meta_model(model_config)
        self.config = PruneConfig.from_dict(settings.model_dump(include=set(PruneSettings.model_fields)))
        self.geometry = Geometry.of(self.model, self.config.dtype)

    def candidate(self, ratio: float, fmt: str, variant: str) -> Candidate | None:
        """The candidate's sizes; None where whole units within r_max cannot reach `ratio` under its rounding."""
        config = self.config.candidate_config(ratio, fmt, variant) if ratio else None
        if config is not None:
            try:
                check_reachable(self.model, config)
            except InvalidConfig:
                return None
        shape = planned_shape(self.model, config)
        if fmt == GGUF:
            size = gguf_bytes(self.geometry, shape, variant)
        else:
            size = safetensors_bytes(self.geometry, shape, variant)
        return Candidate(ratio, fmt, variant, size, shape.params)


def dense_points(model_config: PretrainedConfig, settings: PruneSettings) -> list[Candidate]:
    """The dense model in each variant of the sweep (ratio 0.0): the reference points of the curve."""
    estimator, fmt = Estimator(model_config, settings), sweep_format(settings)
    points = [estimator.candidate(0.0, fmt, variant) for variant in sweep_variants(model_config, settings)]
    return [point for point in points if point is not None]


def sweep_candidates(model_config: PretrainedConfig, settings: PruneSettings) -> list[Candidate]:
    """Every (ratio, variant) the sweep tries, ordered by ratio then variant (as given), without those a bytes or
    parameters budget excludes by estimate or whose ratio whole units cannot reach; InvalidConfig naming the
    budget and the smallest size reachable when none is left."""
    assert settings.target is not None, "only a job with a target sweeps"
    estimator, fmt = Estimator(model_config, settings), sweep_format(settings)
    variants = sweep_variants(model_config, settings)
    candidates = [
        candidate
        for ratio in sorted(settings.ratios)
        for variant in variants
        if (candidate := estimator.candidate(ratio, fmt, variant)) is not None
    ]
    if not candidates:
        raise InvalidConfig(
            f"ratios: whole heads and FFN channels within r_max = {settings.r_max} reach none of "
            f"{', '.join(map(str, sorted(settings.ratios)))} on this model (ask for less, or raise r_max)"
        )
    fitting = [c for c in candidates if within_target(c.estimated_bytes, c.estimated_params, settings.target)]
    if not fitting:
        raise InvalidConfig(_nothing_fits(candidates, settings.target))
    return fitting


def _nothing_fits(candidates: list[Candidate], target: TargetConfig) -> str:
    if target.max_bytes is not None:
        smallest = min(candidates, key=lambda c: (c.estimated_bytes, c.ratio))
        return (
            f"target.max_bytes: no candidate fits in {target.max_bytes} bytes: the smallest reachable is "
            f"{smallest.estimated_bytes} bytes ({describe(smallest)})"
        )
    smallest = min(candidates, key=lambda c: (c.estimated_params, c.ratio))
    return (
        f"target.max_params: no candidate fits in {target.max_params} parameters: the smallest reachable is "
        f"{smallest.estimated_params} parameters ({describe(smallest)})"
    )


def describe(candidate: Candidate) -> str:
    """`ratio 0.6, q4_k_m` (a GGUF type) or `ratio 0.6, safetensors w8a8_int8`."""
    variant = candidate.variant if candidate.format == GGUF else f"{SAFETENSORS} {candidate.variant}"
    return f"ratio {candidate.ratio}, {variant}"


def within_target(entry_bytes: int, entry_params: int, target: TargetConfig) -> bool:
    """Whether a model of these sizes meets a bytes or parameters budget (a perplexity budget: always)."""
    if target.max_bytes is not None:
        return entry_bytes <= target.max_bytes
    if target.max_params is not None:
        return entry_params <= target.max_params
    return True
