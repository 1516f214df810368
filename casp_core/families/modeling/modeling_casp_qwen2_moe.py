"""A Qwen2-MoE whose experts, the shared one too, each keep their own FFN width; attention (with its q/k/v biases),
the router and the shared expert's gate stay whole.

This file is copied into every pruned Qwen2-MoE checkpoint and named in its `auto_map`, so it imports only torch,
transformers and (relatively, which transformers copies along) `modeling_casp_mixtral`, whose per-expert modules
it shares. Per layer `l` and expert `e` the config records `layer_expert_intermediate_sizes[l][e]`, and the shared
expert's width `layer_shared_expert_intermediate_sizes[l]`. Every decoder
layer is a mixture of experts (the family refuses `mlp_only_layers` and a `decoder_sparse_step` above 1).
Sliding-window layers are upstream's, as the config computes them.
"""

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import Qwen2MoeConfig
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    Qwen2MoeAttention,
    Qwen2MoeDecoderLayer,
    Qwen2MoeForCausalLM,
    Qwen2MoeMLP,
    Qwen2MoeModel,
    Qwen2MoePreTrainedModel,
    Qwen2MoeRMSNorm,
    Qwen2MoeRotaryEmbedding,
    Qwen2MoeSparseMoeBlock,
    Qwen2MoeTopKRouter,
)

from .modeling_casp_mixtral import CaspExpert, CaspExperts, layer_router


@strict
class CaspQwen2MoeConfig(Qwen2MoeConfig):
    model_type = "casp_qwen2_moe"

    layer_expert_intermediate_sizes: list | None = None
    layer_shared_expert_intermediate_sizes: list | None = None
    casp: dict | None = None  # provenance: the dense model, the pruning settings

    def __post_init__(self, **kwargs) -> None:
        if self.layer_expert_intermediate_sizes is None:
            self.layer_expert_intermediate_sizes = [
                [self.moe_intermediate_size] * self.num_experts for _ in range(self.num_hidden_layers)
            ]
        if self.layer_shared_expert_intermediate_sizes is None:
            shared_width = self.shared_expert_intermediate_size
            self.layer_shared_expert_intermediate_sizes = [shared_width] * self.num_hidden_layers
        super().__post_init__(**kwargs)


class CaspQwen2MoeSparseMoeBlock(Qwen2MoeSparseMoeBlock):
    """Upstream's block (router, top-k, shared expert and its gate, `forward`) with experts of their own widths."""

    def __init__(self, config: CaspQwen2MoeConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        widths = config.layer_expert_intermediate_sizes[layer_idx]
        self.gate = layer_router(Qwen2MoeTopKRouter(config), len(widths))
        self.experts = CaspExperts(config, widths)
        shared_width = config.layer_shared_expert_intermediate_sizes[layer_idx]
        self.shared_expert = Qwen2MoeMLP(config, intermediate_size=shared_width)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)


class CaspQwen2MoeDecoderLayer(Qwen2MoeDecoderLayer):
    """`__init__` is new so that the dense-width experts are never built; `forward` is upstream's."""

    def __init__(self, config: CaspQwen2MoeConfig, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.self_attn = Qwen2MoeAttention(config, layer_idx)
        self.mlp = CaspQwen2MoeSparseMoeBlock(config, layer_idx)
        self.input_layernorm = Qwen2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_size = config.hidden_size


class CaspQwen2MoePreTrainedModel(Qwen2MoePreTrainedModel):
    config_class = CaspQwen2MoeConfig
    config: CaspQwen2MoeConfig
    _no_split_modules = ["CaspQwen2MoeDecoderLayer"]
    _can_record_outputs = {**Qwen2MoePreTrainedModel._can_record_outputs, "hidden_states": CaspQwen2MoeDecoderLayer}

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, CaspExpert):
            nn.init.normal_(module.gate_up_proj, std=self.config.initializer_range)
            nn.init.normal_(module.down_proj, std=self.config.initializer_range)


class CaspQwen2MoeModel(CaspQwen2MoePreTrainedModel, Qwen2MoeModel):
    """Qwen2-MoE's model with the per-expert decoder layers; `forward` is upstream's."""

    def __init__(self, config: CaspQwen2MoeConfig) -> None:
        CaspQwen2MoePreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [CaspQwen2MoeDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = Qwen2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class CaspQwen2MoeForCausalLM(CaspQwen2MoePreTrainedModel, Qwen2MoeForCausalLM):
    def __init__(self, config: CaspQwen2MoeConfig) -> None:
        CaspQwen2MoePreTrainedModel.__init__(self, config)
        self.model = CaspQwen2MoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()


CaspQwen2MoeConfig.register_for_auto_class()
CaspQwen2MoeForCausalLM.register_for_auto_class("AutoModelForCausalLM")
