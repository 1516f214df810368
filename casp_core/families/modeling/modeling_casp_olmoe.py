"""An OLMoE whose experts each keep their own FFN width; attention (with its q/k norms over all heads) and the
router stay whole.

This file is copied into every pruned OLMoE checkpoint and named in its `auto_map`, so it imports only torch,
transformers and (relatively, which transformers copies along) `modeling_casp_mixtral`, whose per-expert modules
it shares. Per layer `l` and expert `e` the config records `layer_expert_intermediate_sizes[l][e]`.
"""

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import OlmoeConfig
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.olmoe.modeling_olmoe import (
    OlmoeAttention,
    OlmoeDecoderLayer,
    OlmoeForCausalLM,
    OlmoeModel,
    OlmoePreTrainedModel,
    OlmoeRMSNorm,
    OlmoeRotaryEmbedding,
    OlmoeSparseMoeBlock,
    OlmoeTopKRouter,
)

from .modeling_casp_mixtral import CaspExpert, CaspExperts, layer_router


@strict
class CaspOlmoeConfig(OlmoeConfig):
    model_type = "casp_olmoe"

    # transformers 5.4's OlmoeConfig declares this `int`, and huggingface_hub's strict dataclasses then refuse the
    # `false` of the config.json (5.24 declares it `bool`): declared here as it is meant, so that pruned checkpoints
    # load under every transformers the project supports (as casp_olmo2 does).
    tie_word_embeddings: bool = False

    layer_expert_intermediate_sizes: list | None = None
    casp: dict | None = None  # provenance: the dense model, the pruning settings

    def __post_init__(self, **kwargs) -> None:
        if self.layer_expert_intermediate_sizes is None:
            self.layer_expert_intermediate_sizes = [
                [self.intermediate_size] * self.num_experts for _ in range(self.num_hidden_layers)
            ]
        super().__post_init__(**kwargs)


class CaspOlmoeSparseMoeBlock(OlmoeSparseMoeBlock):
    """Upstream's block (router, top-k, `forward`) with experts of their own widths."""

    def __init__(self, config: CaspOlmoeConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        widths = config.layer_expert_intermediate_sizes[layer_idx]
        self.experts = CaspExperts(config, widths)
        self.gate = layer_router(OlmoeTopKRouter(config), len(widths))


class CaspOlmoeDecoderLayer(OlmoeDecoderLayer):
    """`__init__` is new so that the dense-width experts are never built; `forward` is upstream's."""

    def __init__(self, config: CaspOlmoeConfig, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.self_attn = OlmoeAttention(config, layer_idx)
        self.mlp = CaspOlmoeSparseMoeBlock(config, layer_idx)
        self.input_layernorm = OlmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = OlmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_size = config.hidden_size


class CaspOlmoePreTrainedModel(OlmoePreTrainedModel):
    config_class = CaspOlmoeConfig
    config: CaspOlmoeConfig
    _no_split_modules = ["CaspOlmoeDecoderLayer"]
    _can_record_outputs = {**OlmoePreTrainedModel._can_record_outputs, "hidden_states": CaspOlmoeDecoderLayer}

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, CaspExpert):
            nn.init.normal_(module.gate_up_proj, std=self.config.initializer_range)
            nn.init.normal_(module.down_proj, std=self.config.initializer_range)


class CaspOlmoeModel(CaspOlmoePreTrainedModel, OlmoeModel):
    """OLMoE's model with the per-expert decoder layers; `forward` is upstream's."""

    def __init__(self, config: CaspOlmoeConfig) -> None:
        CaspOlmoePreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [CaspOlmoeDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = OlmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = OlmoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class CaspOlmoeForCausalLM(CaspOlmoePreTrainedModel, OlmoeForCausalLM):
    def __init__(self, config: CaspOlmoeConfig) -> None:
        CaspOlmoePreTrainedModel.__init__(self, config)
        self.model = CaspOlmoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()


CaspOlmoeConfig.register_for_auto_class()
CaspOlmoeForCausalLM.register_for_auto_class("AutoModelForCausalLM")
