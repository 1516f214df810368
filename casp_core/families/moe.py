"""Mixtures of experts: each expert's FFN channels are the units; attention and the router are kept whole.

An MoE layer's MLP computes Σ_e w_e(x) down_e(act(gate_e x) ⊙ up_e x) over the top-k experts the router picks for
token x. Written as one FFN, its channels are every expert's channels one after another (channel c of expert e is
channel e x width + c of the layer) and its input is y = (w_e(x) y_e(x))_e, zero for the experts not picked; the
layer's output is then down y exactly, as in a dense layer. So the budget, the reports and the masks speak of the
layer's channels in that numbering (`ExpertStack` stands for the stacked projections), while statistics, Q,
selection and compensation are taken one expert at a time (casp_core.moe): no statistic of two experts together is
ever held.

Why heads stay whole (`prunes_heads = False`): the experts hold nearly all of an MoE layer's parameters (Mixtral
8x7B: 1.4 B of a layer's 1.45 B), so the ratio is met by the experts' channels; the router is never pruned.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from casp_core.config import DENSE_TARGET_COMPENSATION, MEAN_BIAS_COMPENSATION, UNIFORM_SHAPE, PruneSettings
from casp_core.errors import InvalidConfig, VerificationFailed
from casp_core.families.base import SOURCE_ONLY_KEYS, ExpertStack, Family, LayerProjections, kept_index
from casp_core.rounding import channel_counts
from casp_core.units import AttentionGeometry, LayerPruning

# The prefix of the experts' parameters in a decoder layer; everything else in it (attention, router, norms) is kept
# whole.
EXPERTS_PATH = "mlp.experts"
SHARED_EXPERT_PATH = "mlp.shared_expert"  # Qwen2-MoE's expert that every token goes through


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's weights as views (`gate`, `up` [width, hidden], `down` [hidden, width]) and its activation."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    act: nn.Module

    @property
    def width(self) -> int:
        return self.down.shape[1]


def stacked_expert(gate_up: torch.Tensor, down: torch.Tensor, act: nn.Module) -> ExpertWeights:
    width = down.shape[1]
    return ExpertWeights(gate_up[:width], gate_up[width:], down, act)


def expert_weights(layer: nn.Module) -> list[ExpertWeights]:
    """Each routed expert's weights (slices of the dense class's 3-D parameters, or each module's of the pruned
    class), then the shared expert's where the layer has one (Qwen2-MoE: `mlp.shared_expert`, a dense MLP)."""
    experts = layer.get_submodule(EXPERTS_PATH)
    if hasattr(experts, "gate_up_proj"):
        stacks = zip(experts.gate_up_proj, experts.down_proj, strict=True)
        weights = [stacked_expert(gate_up, down, experts.act_fn) for gate_up, down in stacks]
    else:  # the pruned class: one submodule per expert, "0", "1", ...
        modules = [experts.get_submodule(str(index)) for index in range(experts.num_experts)]
        weights = [stacked_expert(module.gate_up_proj, module.down_proj, experts.act_fn) for module in modules]
    shared = getattr(layer.mlp, "shared_expert", None)
    if shared is not None:
        weights.append(
            ExpertWeights(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight, shared.act_fn)
        )
    return weights


def expert_channels(channels: tuple[int, ...] | list[int], widths: list[int]) -> list[list[int]]:
    """The layer's channel numbers (each expert's channels after the previous experts': expert e's channel c is
    e x width + c where the routed experts are alike, the shared expert's come last) as each expert's own."""
    per_expert: list[list[int]] = [[] for _ in widths]
    starts = [sum(widths[:index]) for index in range(len(widths))]
    for channel in sorted(set(channels)):
        expert = max(index for index, start in enumerate(starts) if start <= channel)
        per_expert[expert].append(channel - starts[expert])
    return per_expert


class MixtureOfExperts(Family):
    """What every MoE family shares: experts as 3-D parameters under `mlp.experts` (`gate_up_proj` [E, 2 x width,
    hidden], `down_proj` [E, hidden, width]), a router `mlp.gate` whose forward returns (logits, top-k weights,
    top-k experts) as transformers 5's routers do, and LLaMA's attention."""

    prunes_heads = False
    # The dense config's setting for one expert's width, which the uniform shape sets to the kept width.
    expert_width_key: ClassVar[str] = "intermediate_size"
    # The uniform shape keeps the dense attention; no mean-bias compensation (refused), so no bias switches.
    plain_bias_switches = False
    plain_heads_divide_hidden = False
    # Attention's projections only: the experts are no nn.Linear (`projections` builds their stacks).
    projection_paths: ClassVar[dict[str, str]] = {
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
    }
    gguf = None
    gguf_refusal = (
        "llama.cpp keeps a layer's experts in one 3-D tensor of one width, and per-expert widths have no place "
        "there; use the safetensors checkpoint"
    )

    def check_config(self, config: PretrainedConfig) -> None:
        super().check_config(config)
        top_k, experts = config.num_experts_per_tok, self.num_experts(config)
        if not 0 < top_k <= experts:
            raise InvalidConfig(f"model type {config.model_type!r}: top-{top_k} routing over {experts} experts")

    def num_experts(self, config: PretrainedConfig) -> int:
        return config.num_local_experts

    def expert_width(self, config: PretrainedConfig) -> int:
        """One expert's FFN width in the dense config."""
        return getattr(config, self.expert_width_key)

    def shared_expert_width(self, config: PretrainedConfig) -> int:
        """The FFN width of the expert every token goes through (Qwen2-MoE's), 0 where there is none."""
        return 0

    def prepare(self, model: PreTrainedModel) -> None:
        """transformers' default grouped matrix product for the experts takes no float64, which verification
        computes in: the eager loop over experts computes the same products."""
        model.set_experts_implementation("eager")

    def check_settings(self, config: PretrainedConfig, settings: PruneSettings) -> None:
        refused = {
            "shape": settings.shape == UNIFORM_SHAPE and self.shared_expert_width(config) > 0,
            "alpha": settings.alpha == "auto",
            "compensation": settings.compensation in (MEAN_BIAS_COMPENSATION, DENSE_TARGET_COMPENSATION),
            "calibration.mode": settings.calibration.mode == "dense",
            "target": settings.target is not None,
        }
        for name, is_refused in refused.items():
            if is_refused:
                raise InvalidConfig(
                    f"{name}: {self.name} (a mixture of experts) is pruned with a numeric alpha, least-squares or no "
                    "compensation, sequential calibration and a ratio; the uniform shape only without a shared "
                    "expert (docs/moe.md)"
                )

    def projections(self, layer: nn.Module) -> LayerProjections:
        attention = {part: layer.get_submodule(path) for part, path in self.projection_paths.items()}
        experts = expert_weights(layer)
        return LayerProjections(
            **attention,
            gate=ExpertStack(tuple(e.gate for e in experts), stacked_rows=True),
            up=ExpertStack(tuple(e.up for e in experts), stacked_rows=True),
            down=ExpertStack(tuple(e.down for e in experts), stacked_rows=False),
        )

    @torch.no_grad()
    def mask_channels(self, layer: nn.Module, channels: tuple[int, ...]) -> None:
        experts = expert_weights(layer)
        for expert, own in zip(experts, expert_channels(channels, [e.width for e in experts]), strict=True):
            expert.down[:, own] = 0

    def channel_counts(self, layer: nn.Module, r_max: float, round_to: int | str, block: int | None) -> tuple[int, ...]:
        """Every sum of one count per expert (each expert prunes as a layer of its width would), so that the layer's
        count can be spread over its experts (exactly where they are alike; a shared expert of another width may
        leave some sums out, which the later layers then make up)."""
        own = [channel_counts(expert.width, r_max, round_to, block) for expert in expert_weights(layer)]
        step = math.gcd(*(counts[1] - counts[0] for counts in own if len(counts) > 1)) or 1
        return tuple(range(sum(c[0] for c in own), sum(c[-1] for c in own) + 1, step))

    def uniform_channel_counts(
        self, layer: nn.Module, r_max: float, round_to: int | str, block: int | None
    ) -> tuple[int, ...]:
        """The same count in every expert (all alike in a family the uniform shape takes)."""
        experts = expert_weights(layer)
        return tuple(len(experts) * count for count in channel_counts(experts[0].width, r_max, round_to, block))

    def kept_width(self, layer: nn.Module, pruning: LayerPruning) -> tuple[int, ...]:
        experts = expert_weights(layer)
        per_expert = expert_channels(pruning.pruned_channels, [e.width for e in experts])
        return tuple(e.width - len(own) for e, own in zip(experts, per_expert, strict=True))

    def pruned_config(
        self, model: PreTrainedModel, kv_maps: list[list[int]], widths: list, head_dim: int
    ) -> PretrainedConfig:
        """The dense settings and each layer's experts' widths; attention and the router keep the dense settings."""
        heads = model.config.num_attention_heads
        if any(len(kv_map) != heads for kv_map in kv_maps):
            raise VerificationFailed(f"{self.name} keeps every attention head, and the pruning removed some")
        settings = {k: v for k, v in model.config.to_dict().items() if k not in self.dense_only_keys}
        settings.update(
            **self.width_settings(widths),
            casp=settings.get("casp"),
            architectures=[self.pruned_model_class.__name__],
        )
        return self.pruned_model_class.config_class(**settings)

    def plain_config(
        self,
        config: PretrainedConfig,
        *,
        heads: int,
        kv_heads: int,
        ffn_width: int | tuple[int, ...],
        head_dim: int,
        attention_bias: bool,
        mlp_bias: bool,
    ) -> PretrainedConfig:
        """The dense config with the experts' kept width; attention and the router as they were."""
        widths = set(ffn_width) if isinstance(ffn_width, tuple) else {ffn_width}
        if len(widths) != 1 or heads != config.num_attention_heads:
            raise VerificationFailed("the uniform shape left experts of different widths or removed heads")
        settings = {k: v for k, v in config.to_dict().items() if k not in SOURCE_ONLY_KEYS}
        settings[self.expert_width_key] = widths.pop()
        return type(config)(**settings)

    def plain_layer_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The experts' kept weights stacked into the family's 3-D parameters (all alike in the uniform shape)."""
        names = ("gate_up_proj", "down_proj")
        count = sum(1 for name in tensors if name.startswith(f"{EXPERTS_PATH}.") and name.endswith(".down_proj"))
        stacked = {
            f"{EXPERTS_PATH}.{name}": torch.stack([tensors.pop(f"{EXPERTS_PATH}.{e}.{name}") for e in range(count)])
            for name in names
        }
        return tensors | stacked

    def width_settings(self, widths: list[tuple[int, ...]]) -> dict[str, list]:
        """The pruned config's settings for each layer's experts' widths (`kept_width`'s)."""
        return {"layer_expert_intermediate_sizes": [list(layer_widths) for layer_widths in widths]}

    def pruned_layer_tensors(
        self, layer: nn.Module, geometry: AttentionGeometry, pruning: LayerPruning
    ) -> dict[str, torch.Tensor]:
        """Each expert's kept gate and up rows and down columns, as `mlp.experts.{e}.*` (a shared expert's as
        `mlp.shared_expert.*_proj.weight`); every other parameter of the layer (attention, router, norms, the shared
        expert's gate) whole."""
        experts = expert_weights(layer)
        cut = (f"{EXPERTS_PATH}.", f"{SHARED_EXPERT_PATH}.")
        tensors = {name: p.detach().clone() for name, p in layer.named_parameters() if not name.startswith(cut)}
        routed = layer.get_submodule(EXPERTS_PATH).num_experts
        for index, (expert, own) in enumerate(
            zip(experts, expert_channels(pruning.pruned_channels, [e.width for e in experts]), strict=True)
        ):
            kept = kept_index(expert.width, tuple(own), expert.down.device)
            gate, up, down = expert.gate.index_select(0, kept), expert.up.index_select(0, kept), expert.down[:, kept]
            if index < routed:
                tensors[f"{EXPERTS_PATH}.{index}.gate_up_proj"] = torch.cat([gate, up])
                tensors[f"{EXPERTS_PATH}.{index}.down_proj"] = down
            else:
                for name, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                    tensors[f"{SHARED_EXPERT_PATH}.{name}.weight"] = weight
        return tensors
