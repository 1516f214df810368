"""Mixtures of experts: each expert's FFN channels are the units; attention and the router are kept whole.

An MoE layer's MLP computes Σ_e w_e(x) down_e(act(gate_e x) ⊙ up_e x) over the top-k experts the router picks for
token x. Written as one FFN, its channels are every expert's channels one after another (channel c of expert e is
channel e x width + c of the layer) and its input is y = (w_e(x) y_e(x))_e, zero for the experts not picked; the
layer's output is then down y exactly, as in a dense layer. So the budget, the reports and the masks speak of the
layer's channels in that numbering (`ExpertStack` stands for the stacked projections), while statistics, Q,
selection and compensation are taken one expert at a time (casp_core.method.experts): no statistic of two experts
together is ever held.

Why heads stay whole (`prunes_heads = False`): the experts hold nearly all of an MoE layer's parameters (Mixtral
8x7B: 1.4 B of a layer's 1.45 B), so the ratio is met by the experts' channels; the router loses only the rows of
whole experts removed (`moe.prune_experts`: `route_to_kept_experts`).
"""

import copy
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from casp_core.errors import InvalidConfig, VerificationFailed
from casp_core.families.base import SOURCE_ONLY_KEYS, ExpertStack, Family, LayerProjections, kept_index
from casp_core.rounding import channel_counts
from casp_core.settings import DENSE_TARGET_COMPENSATION, MEAN_BIAS_COMPENSATION, NO_QUANTIZATION, PruneSettings
from casp_core.units import AttentionGeometry, LayerPruning, kept

# The prefix of the experts' parameters in a decoder layer; everything else in it (attention, router, norms) is kept
# whole.
EXPERTS_PATH = "mlp.experts"
SHARED_EXPERT_PATH = "mlp.shared_expert"  # Qwen2-MoE's expert that every token goes through
ROUTER_PATH = "mlp.gate"


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
        weights = [stacked_expert(module.gate_up_proj, module.down_proj, module.act_fn) for module in modules]
    shared = getattr(layer.mlp, "shared_expert", None)
    if shared is not None:
        weights.append(
            ExpertWeights(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight, shared.act_fn)
        )
    return weights


def routed_experts(layer: nn.Module) -> list[ExpertWeights]:
    """The experts the router picks from: `expert_weights` but a shared expert."""
    return expert_weights(layer)[: layer.get_submodule(EXPERTS_PATH).num_experts]


def expert_channels(channels: tuple[int, ...] | list[int], widths: list[int]) -> list[list[int]]:
    """The layer's channel numbers (each expert's channels after the previous experts': expert e's channel c is
    e x width + c where the routed experts are alike, the shared expert's come last) as each expert's own."""
    per_expert: list[list[int]] = [[] for _ in widths]
    starts = [sum(widths[:index]) for index in range(len(widths))]
    for channel in sorted(set(channels)):
        expert = max(index for index, start in enumerate(starts) if start <= channel)
        per_expert[expert].append(channel - starts[expert])
    return per_expert


def route_to_kept_experts(router: nn.Module, kept_experts: list[int]) -> None:
    """From now on `router` routes as the dense router with the other experts' logits at -inf: every family's router
    (transformers' own forward) takes the softmax over all logits, then the top-k, then (Mixtral always; Qwen2-MoE,
    Qwen3-MoE and OLMoE when `norm_topk_prob`) renormalises the top-k weights, so a logit at -inf has probability 0,
    is never picked while top_k experts remain, and leaves the others' softmax the one over the kept experts alone.
    Which is what the router without the other experts' rows computes, and is computed here as such: the router's
    own forward over its kept rows, its picks numbered back to the dense experts. (Not with -inf in the full
    softmax: float32's vectorised sum groups the terms otherwise once -inf columns sit among them, and from 16
    experts up its result differs in the last bit from the sum over the kept ones.)

    A forward hook, so that the masked model's other layers and its state dict are the dense model's; it survives
    `copy.deepcopy`, `.to()` and `.double()`, which verification and the tests use."""
    kept_rows = torch.tensor(kept_experts)

    def masked_routing(module: nn.Module, args: tuple, output: tuple) -> tuple:
        rows = kept_rows.to(module.weight.device)
        without = copy.copy(module)  # the same settings (top_k, norm_topk_prob, ...), the kept rows for weight
        without.__dict__["_parameters"] = {**module._parameters, "weight": module.weight.index_select(0, rows)}
        logits, weights, experts = without.forward(*args)
        every = logits.new_full((logits.shape[0], module.weight.shape[0]), float("-inf"))
        return every.index_copy(1, rows, logits), weights, rows[experts]

    router.register_forward_hook(masked_routing, prepend=True)


class MixtureOfExperts(Family):
    """What every MoE family shares: experts as 3-D parameters under `mlp.experts` (`gate_up_proj` [E, 2 x width,
    hidden], `down_proj` [E, hidden, width]), a router `mlp.gate` whose forward returns (logits, top-k weights,
    top-k experts) as transformers 5's routers do, and LLaMA's attention."""

    prunes_heads = False
    has_experts = True
    # The dense config's setting for one expert's width, which the uniform shape sets to the kept width.
    expert_width_key: ClassVar[str] = "intermediate_size"
    # The dense config's setting for the routed experts' count, which whole-expert removal lowers.
    expert_count_key: ClassVar[str] = "num_experts"
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
    # LoRA on attention's projections, and on the experts' weights as parameters: 3-D in the dense class, a 2-D
    # pair per expert in the pruned one. Naming gate_proj among the modules would also let peft's own v4-to-v5
    # conversion (Qwen3-MoE, OLMoE) put a rank 2r adapter on gate_up_proj in the dense class, r in the pruned one.
    lora_targets: ClassVar[dict[str, str]] = {name: name for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    lora_parameter_targets: ClassVar[dict[str, str]] = {
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
        "down_proj": "down_proj",
    }
    gguf = None
    gguf_refusal = (
        "llama.cpp keeps a layer's experts in one 3-D tensor of one width, and per-expert widths have no place "
        "there; use the safetensors checkpoint"
    )

    def check_config(self, model_config: PretrainedConfig) -> None:
        super().check_config(model_config)
        top_k, experts = model_config.num_experts_per_tok, self.num_experts(model_config)
        if not 0 < top_k <= experts:
            raise InvalidConfig(f"model type {model_config.model_type!r}: top-{top_k} routing over {experts} experts")

    def num_experts(self, model_config: PretrainedConfig) -> int:
        """The routed experts of each layer (a shared expert apart)."""
        return getattr(model_config, self.expert_count_key)

    def expert_width(self, model_config: PretrainedConfig) -> int:
        """One expert's FFN width in the dense config."""
        return getattr(model_config, self.expert_width_key)

    def shared_expert_width(self, model_config: PretrainedConfig) -> int:
        """The FFN width of the expert every token goes through (Qwen2-MoE's), 0 where there is none."""
        return 0

    def prepare(self, model: PreTrainedModel) -> None:
        """transformers' default grouped matrix product for the experts takes no float64, which verification
        computes in: the eager loop over experts computes the same products."""
        model.set_experts_implementation("eager")

    def check_settings(self, model_config: PretrainedConfig, settings: PruneSettings) -> None:
        refused = {
            "alpha": settings.alpha == "auto",
            "compensation": settings.compensation in (MEAN_BIAS_COMPENSATION, DENSE_TARGET_COMPENSATION),
            "calibration.mode": settings.calibration.mode == "dense",
            "target": settings.target is not None,
        }
        for name, is_refused in refused.items():
            if is_refused:
                raise InvalidConfig(
                    f"{name}: {self.name} (a mixture of experts) is pruned with a numeric alpha, least-squares or no "
                    "compensation, sequential calibration and a ratio (docs/moe.md)"
                )
        if settings.quantization != NO_QUANTIZATION:
            raise InvalidConfig(
                f"quantization: {self.name} (a mixture of experts) keeps its experts' weights as parameters, not in "
                "the nn.Linear layers compressed-tensors quantizes, so only attention would be quantized; leave "
                "quantization at none (docs/moe.md)"
            )
        removed, experts, top_k = (
            settings.moe.prune_experts,
            self.num_experts(model_config),
            model_config.num_experts_per_tok,
        )
        if experts - removed < top_k:
            raise InvalidConfig(
                f"moe.prune_experts: removing {removed} of the {experts} experts of every layer leaves fewer than the "
                f"{top_k} the router picks for each token (num_experts_per_tok); remove at most {experts - top_k}"
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

    def mask_experts(self, layer: nn.Module, experts: tuple[int, ...]) -> None:
        """The router routes as if `experts` had no rows (`route_to_kept_experts`); their channels are masked with
        the others (`mask_channels`: a removed expert's are all among the pruned)."""
        router = layer.get_submodule(ROUTER_PATH)
        route_to_kept_experts(router, kept(router.weight.shape[0], experts))

    @torch.no_grad()
    def mask_channels(self, layer: nn.Module, channels: tuple[int, ...]) -> None:
        experts = expert_weights(layer)
        for expert, own in zip(experts, expert_channels(channels, [e.width for e in experts]), strict=True):
            expert.down[:, own] = 0

    def channel_counts(
        self, layer: nn.Module, r_max: float, round_to: int | str, block: int | None, removed_experts: int = 0
    ) -> tuple[int, ...]:
        """Every sum of one count per expert (each expert prunes as a layer of its width would), so that the layer's
        count can be spread over its experts (exactly where they are alike; a shared expert of another width may
        leave some sums out, which the later layers then make up). `removed_experts` whole routed experts count
        first, every channel of theirs: the routed experts are alike, so which ones go changes nothing here."""
        experts = expert_weights(layer)
        removed = sum(expert.width for expert in experts[:removed_experts])
        own = [channel_counts(expert.width, r_max, round_to, block) for expert in experts[removed_experts:]]
        step = math.gcd(*(counts[1] - counts[0] for counts in own if len(counts) > 1)) or 1
        return tuple(range(removed + sum(c[0] for c in own), removed + sum(c[-1] for c in own) + 1, step))

    def uniform_channel_counts(
        self, layer: nn.Module, r_max: float, round_to: int | str, block: int | None, removed_experts: int = 0
    ) -> tuple[int, ...]:
        """The same count in every routed expert kept (they are alike), after the removed experts' channels; a
        shared expert (Qwen2-MoE's) is kept whole, so that its width stays the one setting its config has."""
        experts = routed_experts(layer)
        width, kept_experts = experts[0].width, len(experts) - removed_experts
        counts = channel_counts(width, r_max, round_to, block)
        return tuple(removed_experts * width + kept_experts * count for count in counts)

    def kept_width(self, layer: nn.Module, pruning: LayerPruning) -> tuple[int, ...]:
        """Each kept expert's width, in their order (the removed experts have none)."""
        experts = expert_weights(layer)
        per_expert = expert_channels(pruning.pruned_channels, [e.width for e in experts])
        return tuple(
            e.width - len(own)
            for index, (e, own) in enumerate(zip(experts, per_expert, strict=True))
            if index not in pruning.removed_experts
        )

    def stored_count_key(self, model_config: PretrainedConfig) -> str:
        """The key `to_dict` writes the experts' count under (Qwen3MoeConfig maps `num_experts` to
        `num_local_experts`), which the pruned config's settings must set."""
        return model_config.attribute_map.get(self.expert_count_key, self.expert_count_key)

    def routed_count(self, model_config: PretrainedConfig, widths: list) -> int:
        """The routed experts each layer of `widths` (kept_width's) keeps: the same in every layer."""
        shared = self.shared_expert_width(model_config) > 0
        counts = {len(layer_widths) - shared for layer_widths in widths}
        if len(counts) != 1:
            raise VerificationFailed(f"the pruning left layers with different numbers of experts: {sorted(counts)}")
        return counts.pop()

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
        settings[self.stored_count_key(model.config)] = self.routed_count(model.config, widths)
        return self.pruned_model_class.config_class(**settings)

    def plain_config(
        self,
        model_config: PretrainedConfig,
        *,
        heads: int,
        kv_heads: int,
        ffn_width: int | tuple[int, ...],
        head_dim: int,
        attention_bias: bool,
        mlp_bias: bool,
    ) -> PretrainedConfig:
        """The dense config with the routed experts' kept width; attention, the router and a shared expert as they
        were."""
        layer_widths = ffn_width if isinstance(ffn_width, tuple) else (ffn_width,)
        shared = self.shared_expert_width(model_config)
        if shared:
            layer_widths, shared_kept = layer_widths[:-1], layer_widths[-1]
            if shared_kept != shared:
                raise VerificationFailed("the uniform shape pruned the shared expert, which it keeps whole")
        widths = set(layer_widths)
        if len(widths) != 1 or heads != model_config.num_attention_heads:
            raise VerificationFailed("the uniform shape left experts of different widths or removed heads")
        settings = {k: v for k, v in model_config.to_dict().items() if k not in SOURCE_ONLY_KEYS}
        settings[self.expert_width_key] = widths.pop()
        settings[self.stored_count_key(model_config)] = self.routed_count(model_config, [ffn_width])
        return type(model_config)(**settings)

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
        """Each kept expert's kept gate and up rows and down columns, as `mlp.experts.{e}.*` numbered in their order
        (a shared expert's as `mlp.shared_expert.*_proj.weight`), the router's kept experts' rows; every other
        parameter of the layer (attention, norms, the shared expert's gate) whole."""
        experts = expert_weights(layer)
        cut = (f"{EXPERTS_PATH}.", f"{SHARED_EXPERT_PATH}.")
        tensors = {name: p.detach().clone() for name, p in layer.named_parameters() if not name.startswith(cut)}
        routed = layer.get_submodule(EXPERTS_PATH).num_experts
        kept_experts = kept(routed, pruning.removed_experts)
        router = f"{ROUTER_PATH}.weight"
        tensors[router] = tensors[router].index_select(0, torch.tensor(kept_experts, device=tensors[router].device))
        for index, (expert, own) in enumerate(
            zip(experts, expert_channels(pruning.pruned_channels, [e.width for e in experts]), strict=True)
        ):
            if index in pruning.removed_experts:
                continue
            kept_channels = kept_index(expert.width, tuple(own), expert.down.device)
            gate, up = expert.gate.index_select(0, kept_channels), expert.up.index_select(0, kept_channels)
            down = expert.down[:, kept_channels]
            if index < routed:
                number = kept_experts.index(index)
                tensors[f"{EXPERTS_PATH}.{number}.gate_up_proj"] = torch.cat([gate, up])
                tensors[f"{EXPERTS_PATH}.{number}.down_proj"] = down
            else:
                for name, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                    tensors[f"{SHARED_EXPERT_PATH}.{name}.weight"] = weight
        return tensors
