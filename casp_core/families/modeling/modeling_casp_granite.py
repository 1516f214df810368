"""A Granite (3.x, model_type `granite`) whose decoder layers each keep their own attention heads and FFN width.

This file is copied into every pruned Granite checkpoint and named in its `auto_map`, so it imports only torch,
transformers and (relatively, which transformers copies along) `modeling_casp_llama`. Per layer `l` the config
records what the Llama-family pruned model records: `layer_kv_of_query[l]` (for each kept query head, the index
of the kept key/value head it reads; groups may be uneven and a layer may keep no head), `layer_num_kv_heads[l]`
and `layer_intermediate_sizes[l]`.

Granite is Llama's layout with four multipliers, and each one acts where pruning leaves it exact:
- `embedding_multiplier` scales the embeddings and `logits_scaling` divides the logits: outside the layers;
- `attention_multiplier` replaces 1/sqrt(head_dim) as the attention's scale: per head, so it holds for any head
  count;
- `residual_multiplier` scales each sub-layer's output (o_proj's, down_proj's) before the residual add: a removed
  unit's column contributed nothing to it, as a masked column contributes nothing.
So only the shapes differ from Granite's own classes: the attention is the Llama-family pruned attention (per-layer
heads) with Granite's scale, the MLP the Llama-family pruned MLP (Granite's MLP is Llama's); the decoder layer's,
the model's and the head's `forward` (the multipliers) are Granite's own.
"""

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GraniteConfig
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.granite.modeling_granite import (
    GraniteDecoderLayer,
    GraniteForCausalLM,
    GraniteModel,
    GranitePreTrainedModel,
    GraniteRMSNorm,
    GraniteRotaryEmbedding,
)

from .modeling_casp_llama import CaspLlamaAttention, CaspLlamaMLP


@strict
class CaspGraniteConfig(GraniteConfig):
    model_type = "casp_granite"
    # The Llama-family pruned attention reads whether heads have q/k norms: Granite's have none.
    qk_norm = False

    head_dim: int | None = None  # explicit: a pruned layer's head count says nothing of hidden_size / head_dim
    layer_kv_of_query: list | None = None
    layer_num_kv_heads: list | None = None
    layer_intermediate_sizes: list | None = None
    # Granite's `attention_bias` is one switch for q/k/v/o and `mlp_bias` one for gate/up/down; FLAP's mean-bias
    # compensation biases o_proj and down_proj alone. None: the family's switch.
    attention_qkv_bias: bool | None = None
    attention_o_bias: bool | None = None
    mlp_down_bias: bool | None = None
    # Granite attends fully on every layer (its model builds one full causal mask): None here and "full_attention"
    # for every layer, as the Llama-family pruned attention reads them.
    sliding_window: int | None = None
    layer_types: list | None = None
    casp: dict | None = None  # provenance: the dense model, the pruning settings

    def __post_init__(self, **kwargs) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_qkv_bias is None:
            self.attention_qkv_bias = self.attention_bias
        if self.attention_o_bias is None:
            self.attention_o_bias = self.attention_bias
        if self.mlp_down_bias is None:
            self.mlp_down_bias = self.mlp_bias
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        super().__post_init__(**kwargs)


class CaspGraniteAttention(CaspLlamaAttention):
    """Granite's attention is Llama's with `attention_multiplier` as the scale (GraniteAttention changes only
    that); the Llama-family pruned attention is Llama's with per-layer heads. Only the scale is new."""

    def __init__(self, config: CaspGraniteConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scaling = config.attention_multiplier


class CaspGraniteDecoderLayer(GraniteDecoderLayer):
    """Granite's layer (its `forward` scales each sub-layer's output by `residual_multiplier`) with the layer's own
    heads and width. `__init__` is new so that the dense-shaped attention and MLP are never built."""

    def __init__(self, config: CaspGraniteConfig, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.residual_multiplier = config.residual_multiplier
        self.self_attn = CaspGraniteAttention(config, layer_idx)
        self.mlp = CaspLlamaMLP(config, config.layer_intermediate_sizes[layer_idx])
        self.input_layernorm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class CaspGranitePreTrainedModel(GranitePreTrainedModel):
    config_class = CaspGraniteConfig
    config: CaspGraniteConfig
    _no_split_modules = ["CaspGraniteDecoderLayer"]
    _can_record_outputs = {"hidden_states": CaspGraniteDecoderLayer, "attentions": CaspGraniteAttention}


class CaspGraniteModel(CaspGranitePreTrainedModel, GraniteModel):
    """Granite's model (its `forward` scales the embeddings by `embedding_multiplier`) with per-layer layers."""

    def __init__(self, config: CaspGraniteConfig) -> None:
        CaspGranitePreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embedding_multiplier = config.embedding_multiplier
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [CaspGraniteDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = GraniteRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class CaspGraniteForCausalLM(CaspGranitePreTrainedModel, GraniteForCausalLM):
    """Granite's head (its `forward` divides the logits by `logits_scaling`) over the per-layer model."""

    def __init__(self, config: CaspGraniteConfig) -> None:
        CaspGranitePreTrainedModel.__init__(self, config)
        self.model = CaspGraniteModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


CaspGraniteConfig.register_for_auto_class()
CaspGraniteForCausalLM.register_for_auto_class("AutoModelForCausalLM")
