"""A Qwen3-MoE whose experts each keep their own FFN width; attention (with its per-head q/k norms) and the router
stay whole.

This file is copied into every pruned Qwen3-MoE checkpoint and named in its `auto_map`, so it imports only torch,
transformers and (relatively, which transformers copies along) `modeling_casp_mixtral`, whose per-expert modules
it shares. Per layer `l` and expert `e` the config records `layer_expert_intermediate_sizes[l][e]`. Every decoder
layer is a mixture of experts (the family refuses `mlp_only_layers` and a `decoder_sparse_step` above 1).
"""

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeDecoderLayer,
    Qwen3MoeForCausalLM,
    Qwen3MoeModel,
    Qwen3MoePreTrainedModel,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
    Qwen3MoeSparseMoeBlock,
    Qwen3MoeTopKRouter,
)

from .modeling_casp_mixtral import CaspExpert, CaspExperts, layer_router


@strict
class CaspQwen3MoeConfig(Qwen3MoeConfig):
    model_type = "casp_qwen3_moe"

    layer_expert_intermediate_sizes: list | None = None
    casp: dict | None = None  # provenance: the dense model, the pruning settings

    def __post_init__(self, **kwargs) -> None:
        if self.layer_expert_intermediate_sizes is None:
            self.layer_expert_intermediate_sizes = [
                [self.moe_intermediate_size] * self.num_experts for _ in range(self.num_hidden_layers)
            ]
        super().__post_init__(**kwargs)


class CaspQwen3MoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    """Upstream's block (router, top-k, `forward`) with experts of their own widths."""

    def __init__(self, config: CaspQwen3MoeConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        widths = config.layer_expert_intermediate_sizes[layer_idx]
        self.experts = CaspExperts(config, widths)
        self.gate = layer_router(Qwen3MoeTopKRouter(config), len(widths))


class CaspQwen3MoeDecoderLayer(Qwen3MoeDecoderLayer):
    """`__init__` is new so that the dense-width experts are never built; `forward` is upstream's."""

    def __init__(self, config: CaspQwen3MoeConfig, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.self_attn = Qwen3MoeAttention(config, layer_idx)
        self.mlp = CaspQwen3MoeSparseMoeBlock(config, layer_idx)
        self.input_layernorm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_size = config.hidden_size


class CaspQwen3MoePreTrainedModel(Qwen3MoePreTrainedModel):
    config_class = CaspQwen3MoeConfig
    config: CaspQwen3MoeConfig
    _no_split_modules = ["CaspQwen3MoeDecoderLayer"]
    _can_record_outputs = {**Qwen3MoePreTrainedModel._can_record_outputs, "hidden_states": CaspQwen3MoeDecoderLayer}

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, CaspExpert):
            nn.init.normal_(module.gate_up_proj, std=self.config.initializer_range)
            nn.init.normal_(module.down_proj, std=self.config.initializer_range)


class CaspQwen3MoeModel(CaspQwen3MoePreTrainedModel, Qwen3MoeModel):
    """Qwen3-MoE's model with the per-expert decoder layers; `forward` is upstream's."""

    def __init__(self, config: CaspQwen3MoeConfig) -> None:
        CaspQwen3MoePreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [CaspQwen3MoeDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class CaspQwen3MoeForCausalLM(CaspQwen3MoePreTrainedModel, Qwen3MoeForCausalLM):
    def __init__(self, config: CaspQwen3MoeConfig) -> None:
        CaspQwen3MoePreTrainedModel.__init__(self, config)
        self.model = CaspQwen3MoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()


CaspQwen3MoeConfig.register_for_auto_class()
CaspQwen3MoeForCausalLM.register_for_auto_class("AutoModelForCausalLM")
