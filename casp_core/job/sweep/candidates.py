"""A budget as candidates: the (ratio, format variant) pairs a sweep tries, with their sizes estimated from the
dense model's config before any statistics (casp_core.job.sweep.shapes).

A job with `target` prunes at each of `ratios` and writes each pruned model in each variant of the sweep's format:
GGUF types (`gguf_types`) or compressed-tensors schemes for safetensors (`quantizations`). A bytes or parameters
budget leaves out, before any work, the candidates whose estimate exceeds it; none left is refused, naming the
smallest size reachable. The dense model in each variant is a reference point of the curve. Which variants the
model takes and which ratios whole units reach is the plan's to check (casp_core.job.plan.plan_sweep); this module
sizes what it admits.
"""

from dataclasses import dataclass

from transformers import PretrainedConfig

from casp_core.artifacts.compressed_tensors.size import safetensors_bytes
from casp_core.artifacts.gguf.size import gguf_bytes
from casp_core.artifacts.shapes import Geometry
from casp_core.job.sweep.shapes import meta_model, planned_shape
from casp_core.method.prune import PrunePlan
from casp_core.settings import PruneSettings, TargetConfig

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


class Estimator:
    """Sizes of a model's candidates, from its config and a meta model (casp_core.job.sweep.shapes)."""

    def __init__(self, model_config: PretrainedConfig, settings: PruneSettings) -> None:
        self.model = meta_model(model_config)
        self.geometry = Geometry.of(self.model, settings.dtype)

    def candidate(self, ratio: float, fmt: str, variant: str, prune: PrunePlan | None) -> Candidate:
        """The candidate's sizes, pruned as `prune` says (a plan the job's checks found whole units reach; None:
        the dense model, at ratio 0.0)."""
        shape = planned_shape(self.model, prune)
        if fmt == GGUF:
            size = gguf_bytes(self.geometry, shape, variant)
        else:
            size = safetensors_bytes(self.geometry, shape, variant)
        return Candidate(ratio, fmt, variant, size, shape.params)


def nothing_fits(candidates: list[Candidate], target: TargetConfig) -> str:
    """The refusal of a bytes or parameters budget none of `candidates` meets, naming the smallest."""
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
