"""Gemma 2 and Gemma 3 (text) whose decoder layers each keep their own attention heads and FFN width.

This file is copied into every pruned Gemma checkpoint and named in its `auto_map`, so it imports only torch,
transformers and, relatively, modeling_casp_llama.py (which transformers copies along with it). As in that file,
per layer `l` the config records `layer_kv_of_query[l]` (for each kept query head, the index of the kept key/value
head it reads), `layer_num_kv_heads[l]` and `layer_intermediate_sizes[l]`; groups may be uneven and a layer may
keep no head.

Everything else is Gemma's own and comes from transformers' classes unchanged: head_dim apart from hidden_size,
the norms before and after attention and the MLP (RMSNorm as x * (1 + w)), the embedding scaled by
sqrt(hidden_size), query_pre_attn_scalar, attention and final logit soft-capping (Gemma 2), per-head q/k norms
over head_dim (Gemma 3, shared by the heads, so kept whole), sliding and global layers per `layer_types`, and
Gemma 3's rope per layer type (a local base for sliding layers). Only the constructors differ, because upstream
sizes every layer from `num_attention_heads`, `num_key_value_heads` and `intermediate_size`; the forwards are
upstream's, except on the two layer shapes upstream cannot express (uneven key/value groups, no head at all).
"""

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import Gemma2Config, Gemma3TextConfig
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import PreTrainedModel
from transformers.models.gemma2.modeling_gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2MLP,
    Gemma2Model,
    Gemma2PreTrainedModel,
    Gemma2RMSNorm,
    Gemma2RotaryEmbedding,
    Gemma2TextScaledWordEmbedding,
)
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3Attention,
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3PreTrainedModel,
    Gemma3RMSNorm,
    Gemma3RotaryEmbedding,
    Gemma3TextModel,
    Gemma3TextScaledWordEmbedding,
)

from .modeling_casp_llama import CACHE_ARGUMENT, CaspLlamaAttention, KeyValueGather, even_group_size


@strict
class CaspGemma2Config(Gemma2Config):
    model_type = "casp_gemma2"

    layer_kv_of_query: list | None = None
    layer_num_kv_heads: list | None = None
    layer_intermediate_sizes: list | None = None
    # Gemma's `attention_bias` is one switch for q/k/v/o and it has no MLP bias; mean-bias compensation (FLAP)
    # biases o_proj and down_proj alone. The same switches as casp_llama's; None: `attention_bias`.
    attention_qkv_bias: bool | None = None
    attention_o_bias: bool | None = None
    mlp_down_bias: bool = False
    casp: dict | None = None  # provenance: the dense model, the pruning settings

    def __post_init__(self, **kwargs) -> None:
        if self.attention_qkv_bias is None:
            self.attention_qkv_bias = self.attention_bias
        if self.attention_o_bias is None:
            self.attention_o_bias = self.attention_bias
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        """Gemma asks hidden_size to be a multiple of the head count; head_dim is explicit and each layer keeps its
        own heads, so there is nothing to ask."""


@strict
class CaspGemma3TextConfig(Gemma3TextConfig):
    """The same per-layer settings as CaspGemma2Config, on Gemma 3's config (its rope per layer type)."""

    model_type = "casp_gemma3_text"

    layer_kv_of_query: list | None = None
    layer_num_kv_heads: list | None = None
    layer_intermediate_sizes: list | None = None
    attention_qkv_bias: bool | None = None
    attention_o_bias: bool | None = None
    mlp_down_bias: bool = False
    casp: dict | None = None

    def __post_init__(self, **kwargs) -> None:
        if self.attention_qkv_bias is None:
            self.attention_qkv_bias = self.attention_bias
        if self.attention_o_bias is None:
            self.attention_o_bias = self.attention_bias
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        """As for CaspGemma2Config: nothing to ask."""


class LayerHeadsAttention:
    """What a Gemma attention that keeps its own query heads adds to upstream's: the projections sized from the
    layer's head counts, and a forward that hands upstream's forward one key/value head per query head where the
    groups are uneven (repeat_kv needs equal contiguous groups) and skips it where no head is left."""

    def init_layer_heads(self, config: CaspGemma2Config | CaspGemma3TextConfig, layer_idx: int) -> None:
        """Upstream's attributes, with the head counts and projections of layer `layer_idx`."""
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.head_dim = config.head_dim
        self.kv_of_query = list(config.layer_kv_of_query[layer_idx])
        self.num_heads = len(self.kv_of_query)
        self.num_kv_heads = config.layer_num_kv_heads[layer_idx]
        group = even_group_size(self.kv_of_query, self.num_kv_heads)
        self.gather_kv = group is None and self.num_heads > 0
        self.num_key_value_groups = 1 if group is None else group
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = not config.use_bidirectional_attention
        self.attn_logit_softcapping = config.attn_logit_softcapping
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        bias = config.attention_qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_o_bias)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.num_heads == 0:
            return self.forward_without_heads(hidden_states, kwargs.get(CACHE_ARGUMENT))
        if self.gather_kv:
            kwargs[CACHE_ARGUMENT] = KeyValueGather(kwargs.get(CACHE_ARGUMENT), self.kv_of_query)
        return super().forward(hidden_states, **kwargs)

    # o_proj's bias (or zeros), the cache kept at the right length: the same as for a pruned Llama. Gemma's
    # post-attention norm then maps that output to what it maps the masked layer's to.
    forward_without_heads = CaspLlamaAttention.forward_without_heads


class CaspGemma2Attention(LayerHeadsAttention, Gemma2Attention):
    def __init__(self, config: CaspGemma2Config, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.init_layer_heads(config, layer_idx)


class CaspGemma3Attention(LayerHeadsAttention, Gemma3Attention):
    """Gemma 3 adds a q and a k norm over head_dim, shared by all heads of the layer: removing heads leaves them
    whole."""

    def __init__(self, config: CaspGemma3TextConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.init_layer_heads(config, layer_idx)
        self.is_sliding = self.layer_type == "sliding_attention"
        self.q_norm = Gemma3RMSNorm(dim=config.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(dim=config.head_dim, eps=config.rms_norm_eps)


class CaspGemmaMLP(Gemma2MLP):
    """The layer's own width, and a bias on down_proj alone where compensation gave it one. Gemma 3's MLP is Gemma
    2's, so both families use this one."""

    def __init__(self, config: CaspGemma2Config | CaspGemma3TextConfig, intermediate_size: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, self.hidden_size, bias=config.mlp_down_bias)
        self.act_fn = ACT2FN[config.hidden_activation]


class LayerShapesDecoderLayer:
    """Upstream's four norms around the layer's own attention and MLP."""

    attention_class: type[nn.Module]
    norm_class: type[nn.Module]

    def __init__(self, config: CaspGemma2Config | CaspGemma3TextConfig, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.config = config
        self.hidden_size = config.hidden_size
        self.layer_idx = layer_idx
        self.self_attn = self.attention_class(config, layer_idx)
        self.mlp = CaspGemmaMLP(config, config.layer_intermediate_sizes[layer_idx])
        self.input_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)


class CaspGemma2DecoderLayer(LayerShapesDecoderLayer, Gemma2DecoderLayer):
    attention_class = CaspGemma2Attention
    norm_class = Gemma2RMSNorm


class CaspGemma3DecoderLayer(LayerShapesDecoderLayer, Gemma3DecoderLayer):
    attention_class = CaspGemma3Attention
    norm_class = Gemma3RMSNorm


class LayerShapesModel:
    """Upstream's model (scaled embedding, final norm, rotary tables, forward) around the per-layer decoder
    layers; upstream's constructor would build every layer at the dense shape."""

    layer_class: type[nn.Module]
    embedding_class: type[nn.Embedding]
    norm_class: type[nn.Module]
    rotary_class: type[nn.Module]

    def __init__(self, config: CaspGemma2Config | CaspGemma3TextConfig) -> None:
        # Not upstream's constructor (the next one in the method order): it would build the dense layers.
        PreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = self.embedding_class(
            config.vocab_size, config.hidden_size, self.padding_idx, embed_scale=config.hidden_size**0.5
        )
        self.layers = nn.ModuleList([self.layer_class(config, index) for index in range(config.num_hidden_layers)])
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = self.rotary_class(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class CaspGemma2PreTrainedModel(Gemma2PreTrainedModel):
    config_class = CaspGemma2Config
    config: CaspGemma2Config
    _no_split_modules = ["CaspGemma2DecoderLayer"]
    _can_record_outputs = {"hidden_states": CaspGemma2DecoderLayer, "attentions": CaspGemma2Attention}


class CaspGemma2Model(LayerShapesModel, CaspGemma2PreTrainedModel, Gemma2Model):
    layer_class = CaspGemma2DecoderLayer
    embedding_class = Gemma2TextScaledWordEmbedding
    norm_class = Gemma2RMSNorm
    rotary_class = Gemma2RotaryEmbedding


class CaspGemma2ForCausalLM(CaspGemma2PreTrainedModel, Gemma2ForCausalLM):
    """Gemma 2's head and final logit soft-capping over the per-layer model."""

    def __init__(self, config: CaspGemma2Config) -> None:
        CaspGemma2PreTrainedModel.__init__(self, config)
        self.model = CaspGemma2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class CaspGemma3PreTrainedModel(Gemma3PreTrainedModel):
    config_class = CaspGemma3TextConfig
    config: CaspGemma3TextConfig
    _no_split_modules = ["CaspGemma3DecoderLayer"]
    _can_record_outputs = {"hidden_states": CaspGemma3DecoderLayer, "attentions": CaspGemma3Attention}
    input_modalities = ("text",)  # Gemma3PreTrainedModel's are the multimodal model's: image and text


class CaspGemma3TextModel(LayerShapesModel, CaspGemma3PreTrainedModel, Gemma3TextModel):
    layer_class = CaspGemma3DecoderLayer
    embedding_class = Gemma3TextScaledWordEmbedding
    norm_class = Gemma3RMSNorm
    rotary_class = Gemma3RotaryEmbedding


class CaspGemma3ForCausalLM(CaspGemma3PreTrainedModel, Gemma3ForCausalLM):
    """Gemma 3's head over the per-layer model (final soft-capping where the config sets it)."""

    def __init__(self, config: CaspGemma3TextConfig) -> None:
        CaspGemma3PreTrainedModel.__init__(self, config)
        self.model = CaspGemma3TextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


CaspGemma2Config.register_for_auto_class()
CaspGemma2ForCausalLM.register_for_auto_class("AutoModelForCausalLM")
CaspGemma3TextConfig.register_for_auto_class()
CaspGemma3ForCausalLM.register_for_auto_class("AutoModelForCausalLM")
