"""What pruning returns: one report per sub-layer and per layer, and the pruned model with its figures.

The pipeline builds these and the report writes them; both import them from here.
"""

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel

from casp_core.method.compensation import CompensationReport
from casp_core.method.placement import Placement
from casp_core.method.surgery import LayerPruning


@dataclass
class SubLayerReport:
    units: int
    pruned: list[int]
    objective: float  # the chosen solver's z'Qz
    diagonal_objective: float  # the independent baseline's z'Qz on the same Q
    offdiag_ratio: float  # rho of the unit-level Q (block-aggregated for heads)
    lower_bound: float | None = None  # relaxation only
    compensation: CompensationReport | None = None  # least-squares refit of the kept units, when asked for


@dataclass
class ExpertReport:
    """One expert of a mixture-of-experts layer: what the calibration tokens brought it and what it lost."""

    index: int
    tokens: int  # calibration tokens the router sent to it
    token_share: float  # of all calibration tokens
    routed_mass: float  # the router's weights for it, summed over the tokens, per token
    sensitivity: float  # S_e = E||w_e W_e y_e||^2: its share of the layer's output energy (docs/moe.md)
    reached: bool  # False: no calibration token reached it (kept whole unless moe.prune_unreached)
    pruned_channels: int
    shared: bool = False  # Qwen2-MoE's shared expert (numbered after the routed ones), which every token goes through
    # Removed whole (moe.prune_experts; its router row too): then what the calibration tokens brought it is the dense
    # routing's, which chose it, and pruned_channels its width.
    removed: bool = False


@dataclass
class LayerReport:
    index: int
    ratio: float  # r_l from the allocation
    sensitivity: float | None
    pruned_heads: list[int]
    pruned_channels: list[int]
    pruned_kv_heads: list[int]
    attn: SubLayerReport
    mlp: SubLayerReport
    params_before: int
    params_after: int
    experts: list[ExpertReport] | None = None  # a mixture of experts' layer only

    @property
    def pruning(self) -> LayerPruning:
        removed = tuple(expert.index for expert in self.experts or () if expert.removed)
        return LayerPruning(tuple(self.pruned_heads), tuple(self.pruned_channels), removed)


@dataclass
class TemperatureChoice:
    """alpha "auto": the temperature chosen, and the held-out loss of each one tried (in the order tried)."""

    alpha: float
    held_out_loss: dict[float, float]
    held_out_windows: int
    statistics_windows: int

    def summary(self) -> dict[str, object]:
        return {
            "chosen": self.alpha,
            "grid": [{"alpha": alpha, "held_out_loss": loss} for alpha, loss in self.held_out_loss.items()],
            "held_out_windows": self.held_out_windows,
            "statistics_windows": self.statistics_windows,
            "score": TEMPERATURE_SCORE,
        }

    def message(self) -> str:
        losses = ", ".join(f"{alpha:g}: {loss:.4f}" for alpha, loss in self.held_out_loss.items())
        return f"alpha auto: {self.alpha:g}, the lowest held-out loss of {losses}"


TEMPERATURE_SCORE = (
    "mean next-token cross-entropy on the held-out calibration windows of the model pruned (masked and compensated) "
    "with each temperature's ratios, units chosen from dense-model statistics of the other windows"
)


@dataclass
class PruneResult:
    model: PreTrainedModel  # CaspLlamaForCausalLM, or the source family's own class for the uniform shape
    layers: list[LayerReport]
    params_dense: int
    params_pruned: int
    verification_max_abs_diff: float  # float64, largest over the stages `verify` compares
    verification_max_relative_diff: float  # what the rule bounds: difference / the stage's largest output
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    temperature: TemperatureChoice | None = None  # alpha "auto" only
    placement: Placement | None = None  # where the weights were while layers were pruned
    rounding: dict[str, Any] | None = None  # `budget.rounding_units`: the units the layers were pruned in

    @property
    def achieved_ratio(self) -> float:
        return 1.0 - self.params_pruned / self.params_dense


__all__ = ["ExpertReport", "LayerReport", "PruneResult", "SubLayerReport", "TemperatureChoice"]
