"""A Phi-3 (Phi-3, Phi-3.5, Phi-4, Phi-4-mini) whose decoder layers each keep their own attention heads and FFN width.

This file is copied into every pruned Phi-3 checkpoint and named in its `auto_map`, so it imports only torch,
transformers and, relatively, the pieces it shares with the pruned LLaMA (`modeling_casp_llama.py`, which
transformers copies along with this file). Per layer `l` the config records `layer_kv_of_query[l]` (for each
kept query head, the index of the kept key/value head it reads), `layer_num_kv_heads[l]` and
`layer_intermediate_sizes[l]`, as the pruned LLaMA's does.

The projections stay fused as in Phi-3: a layer's `qkv_proj` has its `H_l` query heads' rows, then its `KV_l`
key heads' rows, then its value heads' rows ((H_l + 2 KV_l) * head_dim rows); its `gate_up_proj` has `F_l` gate
rows, then `F_l` up rows. Partial rotary (Phi-4-mini rotates 3/4 of each head) and the rope scalings are
Phi-3's own, from the config's `rope_parameters` and `head_dim`.
"""

from collections.abc import Callable

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.phi3.configuration_phi3 import Phi3Config
from transformers.models.phi3.modeling_phi3 import (
    Phi3Attention,
    Phi3DecoderLayer,
    Phi3ForCausalLM,
    Phi3MLP,
    Phi3Model,
    Phi3PreTrainedModel,
    Phi3RMSNorm,
    Phi3RotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .modeling_casp_llama import CACHE_ARGUMENT, CaspLlamaAttention, KeyValueGather, even_group_size


@strict
class CaspPhi3Config(Phi3Config):
    model_type = "casp_phi3"

    # Phi3Config takes head_dim as hidden_size / heads unless the config states it; a pruned config always does.
    head_dim: int | None = None
    layer_kv_of_query: list | None = None
    layer_num_kv_heads: list | None = None
    layer_intermediate_sizes: list | None = None
    # Phi-3 has no bias anywhere; FLAP's mean-bias compensation gives o_proj and down_proj one.
    attention_o_bias: bool = False
    mlp_down_bias: bool = False
    casp: dict | None = None  # provenance: the dense model, the pruning settings


class CaspPhi3Attention(Phi3Attention):
    """Phi-3's attention with the layer's own heads. Upstream's `__init__` sizes qkv_proj and o_proj from the
    config's head counts, and its `forward` splits qkv_proj's output at `config.num_attention_heads` query heads,
    so both are replaced; the rotary embedding, the attention functions and the cache are upstream's. As in the
    pruned LLaMA, a layer whose query heads read their key/value heads in uneven groups hands attention one
    key/value head per query head (`KeyValueGather`), and a layer that kept no head adds only o_proj's bias."""

    def __init__(self, config: CaspPhi3Config, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.kv_of_query = list(config.layer_kv_of_query[layer_idx])
        self.num_heads = len(self.kv_of_query)
        self.num_key_value_heads = config.layer_num_kv_heads[layer_idx]
        group = even_group_size(self.kv_of_query, self.num_key_value_heads)
        self.gather_kv = group is None and self.num_heads > 0
        self.num_key_value_groups = 1 if group is None else group
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        rows = (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, rows, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_o_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The cache argument's name depends on the transformers version (modeling_casp_llama.CACHE_ARGUMENT).
        cache = kwargs.pop(CACHE_ARGUMENT, None)
        if self.num_heads == 0:
            return self.forward_without_heads(hidden_states, cache)
        if self.gather_kv:
            cache = KeyValueGather(cache, self.kv_of_query)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_rows = self.num_heads * self.head_dim
        kv_rows = self.num_key_value_heads * self.head_dim
        query_states, key_states, value_states = self.qkv_proj(hidden_states).split(
            [query_rows, kv_rows, kv_rows], dim=-1
        )
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=getattr(self.config, "sliding_window", None),
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    # Touches only o_proj and the cache, which the two families share.
    forward_without_heads = CaspLlamaAttention.forward_without_heads


class CaspPhi3MLP(Phi3MLP):
    """Phi-3's MLP with the layer's own width; upstream's forward splits gate_up_proj's output in halves, whatever
    its width, so only `__init__` is new."""

    def __init__(self, config: CaspPhi3Config, intermediate_size: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=config.mlp_down_bias)
        self.activation_fn = ACT2FN[config.hidden_act]


class CaspPhi3DecoderLayer(Phi3DecoderLayer):
    """Upstream's layer around the layer's own attention and MLP."""

    def __init__(self, config: CaspPhi3Config, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = CaspPhi3Attention(config, layer_idx)
        self.mlp = CaspPhi3MLP(config, config.layer_intermediate_sizes[layer_idx])
        self.input_layernorm = Phi3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Phi3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.config = config
        self.resid_attn_dropout = nn.Dropout(config.resid_pdrop)
        self.resid_mlp_dropout = nn.Dropout(config.resid_pdrop)


class CaspPhi3PreTrainedModel(Phi3PreTrainedModel):
    config_class = CaspPhi3Config
    config: CaspPhi3Config
    _no_split_modules = ["CaspPhi3DecoderLayer"]
    _can_record_outputs = {"hidden_states": CaspPhi3DecoderLayer, "attentions": CaspPhi3Attention}


class CaspPhi3Model(CaspPhi3PreTrainedModel, Phi3Model):
    """Upstream's model (its forward included) over the pruned layers."""

    def __init__(self, config: CaspPhi3Config) -> None:
        CaspPhi3PreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [CaspPhi3DecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = Phi3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Phi3RotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class CaspPhi3ForCausalLM(CaspPhi3PreTrainedModel, Phi3ForCausalLM):
    """Upstream's causal LM (its switch between short and long rope in generation included) over the pruned model."""

    def __init__(self, config: CaspPhi3Config) -> None:
        CaspPhi3PreTrainedModel.__init__(self, config)
        self.model = CaspPhi3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


CaspPhi3Config.register_for_auto_class()
CaspPhi3ForCausalLM.register_for_auto_class("AutoModelForCausalLM")
