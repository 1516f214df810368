"""A Mixtral whose experts each keep their own FFN width; attention and the router stay whole.

This file is copied into every pruned Mixtral checkpoint and named in its `auto_map`, so it imports only torch and
transformers. Per layer `l` and expert `e` the config records `layer_expert_intermediate_sizes[l][e]`.

What differs from Mixtral's own classes, and nothing else: the experts. Mixtral keeps them as two 3-D parameters
(`gate_up_proj` [experts, 2 x width, hidden], `down_proj` [experts, hidden, width]), which need one width for all;
here each expert is a module of its own with its own width (`mlp.experts.{e}.gate_up_proj` [2 x width_e, hidden],
`mlp.experts.{e}.down_proj` [hidden, width_e]) and the forward is upstream's eager loop over the experts the router
picked: the same products, in the same order, on the kept channels. The router and its top-k are upstream's, with
one row per expert the layer keeps (whole experts may have been removed: `len(layer_expert_intermediate_sizes[l])`
experts in layer `l`).
"""

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import MixtralConfig, PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.mixtral.modeling_mixtral import (
    MixtralAttention,
    MixtralDecoderLayer,
    MixtralForCausalLM,
    MixtralModel,
    MixtralPreTrainedModel,
    MixtralRMSNorm,
    MixtralRotaryEmbedding,
    MixtralSparseMoeBlock,
    MixtralTopKRouter,
)


@strict
class CaspMixtralConfig(MixtralConfig):
    model_type = "casp_mixtral"

    layer_expert_intermediate_sizes: list | None = None
    casp: dict | None = None  # provenance: the dense model, the pruning settings

    def __post_init__(self, **kwargs) -> None:
        if self.layer_expert_intermediate_sizes is None:
            self.layer_expert_intermediate_sizes = [
                [self.intermediate_size] * self.num_local_experts for _ in range(self.num_hidden_layers)
            ]
        super().__post_init__(**kwargs)


class CaspExpert(nn.Module):
    """One expert's gated FFN, `width` channels wide: gate and up rows stacked as upstream stacks them.

    The expert computes itself (upstream's loop reads slice e of its 3-D weights instead) so that a module wrapping
    it sees its weights used: peft's LoRA on a parameter (`target_parameters`) adds the adapter only while the
    module that owns the parameter runs."""

    def __init__(self, hidden_size: int, width: int, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * width, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, width))
        self.act_fn = act_fn

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(hidden_states, self.gate_up_proj).chunk(2, dim=-1)
        return nn.functional.linear(self.act_fn(gate) * up, self.down_proj)


def layer_router(router: nn.Module, experts: int) -> nn.Module:
    """Upstream's `router` (built for the config's expert count) with one row for each of the layer's `experts`."""
    router.num_experts = experts
    router.weight = nn.Parameter(torch.empty(experts, router.hidden_dim))
    return router


class CaspExperts(nn.Module):
    """The experts of one layer, each its own width, as submodules "0", "1", ...; `forward` is upstream's eager
    `MixtralExperts.forward` (which Qwen3-MoE's and OLMoE's share) with expert e computed by module e instead of
    from slice e of the 3-D parameters. The pruned Qwen3-MoE and OLMoE classes import it from here."""

    def __init__(self, config: PretrainedConfig, widths: list[int]) -> None:
        super().__init__()
        self.num_experts = len(widths)
        act_fn = ACT2FN[config.hidden_act]
        for index, width in enumerate(widths):
            self.add_module(str(index), CaspExpert(config.hidden_size, width, act_fn))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit.flatten().tolist():
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current = self.get_submodule(str(expert_idx))(hidden_states[token_idx])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
        return final_hidden_states


class CaspMixtralSparseMoeBlock(MixtralSparseMoeBlock):
    """Upstream's block (router, top-k, `forward`) with experts of their own widths."""

    def __init__(self, config: CaspMixtralConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.top_k = config.num_experts_per_tok
        self.jitter_noise = config.router_jitter_noise
        widths = config.layer_expert_intermediate_sizes[layer_idx]
        self.gate = layer_router(MixtralTopKRouter(config), len(widths))
        self.experts = CaspExperts(config, widths)


class CaspMixtralDecoderLayer(MixtralDecoderLayer):
    """`__init__` is new so that the dense-width experts are never built; `forward` is upstream's."""

    def __init__(self, config: CaspMixtralConfig, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = MixtralAttention(config, layer_idx)
        self.mlp = CaspMixtralSparseMoeBlock(config, layer_idx)
        self.input_layernorm = MixtralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MixtralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class CaspMixtralPreTrainedModel(MixtralPreTrainedModel):
    config_class = CaspMixtralConfig
    config: CaspMixtralConfig
    _no_split_modules = ["CaspMixtralDecoderLayer"]
    _can_record_outputs = {**MixtralPreTrainedModel._can_record_outputs, "hidden_states": CaspMixtralDecoderLayer}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, CaspExpert):
            nn.init.normal_(module.gate_up_proj, std=self.config.initializer_range)
            nn.init.normal_(module.down_proj, std=self.config.initializer_range)


class CaspMixtralModel(CaspMixtralPreTrainedModel, MixtralModel):
    """Mixtral's model with the per-expert decoder layers; `forward` is upstream's."""

    def __init__(self, config: CaspMixtralConfig) -> None:
        CaspMixtralPreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [CaspMixtralDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = MixtralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MixtralRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class CaspMixtralForCausalLM(CaspMixtralPreTrainedModel, MixtralForCausalLM):
    def __init__(self, config: CaspMixtralConfig) -> None:
        CaspMixtralPreTrainedModel.__init__(self, config)
        self.model = CaspMixtralModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_local_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()


CaspMixtralConfig.register_for_auto_class()
CaspMixtralForCausalLM.register_for_auto_class("AutoModelForCausalLM")
