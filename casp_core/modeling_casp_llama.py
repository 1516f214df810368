"""A LLaMA whose decoder layers each keep their own attention heads and FFN width.

This file is copied into every pruned checkpoint and named in its `auto_map`, so it must stay self-contained:
it imports only torch and transformers, never casp_core. Per layer `l` the config records
`layer_kv_of_query[l]` (for each kept query head, the index of the kept key/value head it reads),
`layer_num_kv_heads[l]` and `layer_intermediate_sizes[l]`. Groups may be uneven after pruning (one key/value
head serving three query heads, another one), which `repeat_kv` cannot express, so uneven layers map query
heads to key/value heads explicitly.

The same class carries every supported dense family, which differ from Llama only in settings: Mistral attends
within a sliding window, Qwen2 biases q/k/v but not o (and may slide on some layers), Qwen3 normalises each
query and key head (RMSNorm over head_dim) and sets head_dim apart from hidden_size / heads.
"""

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.models.qwen2.modeling_qwen2 import Qwen2Model


@strict
class CaspLlamaConfig(LlamaConfig):
    model_type = "casp_llama"

    layer_kv_of_query: list | None = None
    layer_num_kv_heads: list | None = None
    layer_intermediate_sizes: list | None = None
    # Llama's `attention_bias` is one switch for q/k/v/o; Qwen2 biases q/k/v only. None: `attention_bias`, as
    # in checkpoints written before these settings.
    attention_qkv_bias: bool | None = None
    attention_o_bias: bool | None = None
    # A bias on down_proj alone (FLAP's mean-bias compensation adds one); Llama's `mlp_bias` would add biases to
    # gate_proj and up_proj too. None: `mlp_bias`, as in checkpoints written before this setting.
    mlp_down_bias: bool | None = None
    qk_norm: bool = False  # Qwen3: one RMSNorm over head_dim for all query heads, one for all key heads
    sliding_window: int | None = None
    layer_types: list | None = None  # per layer "full_attention" or "sliding_attention"; None: all full
    casp: dict | None = None  # provenance: the dense model, the pruning settings

    def __post_init__(self, **kwargs) -> None:
        if self.attention_qkv_bias is None:
            self.attention_qkv_bias = self.attention_bias
        if self.attention_o_bias is None:
            self.attention_o_bias = self.attention_bias
        if self.mlp_down_bias is None:
            self.mlp_down_bias = self.mlp_bias
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        """Llama asks hidden_size to be a multiple of the head count; here head_dim is always explicit (Qwen3
        sets it apart from hidden_size / heads) and each layer keeps its own heads, so there is nothing to ask."""


def even_group_size(kv_of_query: list[int], num_kv_heads: int) -> int | None:
    """The group size when query heads read key/value heads in equal contiguous groups, else None."""
    if num_kv_heads == 0 or len(kv_of_query) % num_kv_heads:
        return None
    group = len(kv_of_query) // num_kv_heads
    return group if list(kv_of_query) == [q // group for q in range(len(kv_of_query))] else None


class CaspLlamaAttention(LlamaAttention):
    def __init__(self, config: CaspLlamaConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.kv_of_query = list(config.layer_kv_of_query[layer_idx])
        self.num_heads = len(self.kv_of_query)
        self.num_kv_heads = config.layer_num_kv_heads[layer_idx]
        group = even_group_size(self.kv_of_query, self.num_kv_heads)
        # Uneven groups: key/value heads are gathered per query head, after which every group has size 1.
        self.gather_kv = group is None
        self.num_key_value_groups = 1 if group is None else group
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        bias = config.attention_qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_o_bias)
        if config.qk_norm:
            # Shared by all heads of the layer, so removing heads leaves them whole.
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        query = self.q_proj(hidden_states).view(*input_shape, self.num_heads, self.head_dim)
        key = self.k_proj(hidden_states).view(*input_shape, self.num_kv_heads, self.head_dim)
        if self.config.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(*input_shape, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if self.num_heads == 0:
            if past_key_values is not None:
                # transformers reads the cached length from the entries and counts an empty one as 0: a
                # one-channel placeholder keeps the positions of later tokens right.
                placeholder = hidden_states.new_zeros(*input_shape[:-1], 1, input_shape[-1], 1)
                past_key_values.update(placeholder, placeholder, self.layer_idx)
            return self.o_proj(hidden_states.new_zeros(*input_shape, 0)), None
        if past_key_values is not None:
            # The cache holds only the kept key/value heads: pruning shrinks it too.
            key, value = past_key_values.update(key, value, self.layer_idx)
        if self.gather_kv:
            index = torch.tensor(self.kv_of_query, device=key.device)
            key, value = key.index_select(1, index), value.index_select(1, index)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, self.num_heads * self.head_dim).contiguous()
        return self.o_proj(attn_output), attn_weights


class CaspLlamaMLP(LlamaMLP):
    def __init__(self, config: CaspLlamaConfig, intermediate_size: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(intermediate_size, self.hidden_size, bias=config.mlp_down_bias)
        self.act_fn = ACT2FN[config.hidden_act]


class CaspLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: CaspLlamaConfig, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = CaspLlamaAttention(config, layer_idx)
        self.mlp = CaspLlamaMLP(config, config.layer_intermediate_sizes[layer_idx])
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class CaspLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = CaspLlamaConfig
    config: CaspLlamaConfig
    _no_split_modules = ["CaspLlamaDecoderLayer"]
    _can_record_outputs = {"hidden_states": CaspLlamaDecoderLayer, "attentions": CaspLlamaAttention}


class CaspLlamaModel(CaspLlamaPreTrainedModel, LlamaModel):
    def __init__(self, config: CaspLlamaConfig) -> None:
        CaspLlamaPreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [CaspLlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.has_sliding_layers = "sliding_attention" in config.layer_types
        self.post_init()

    # Llama's forward with one causal mask per layer type (full, sliding window) chosen by `layer_types`:
    # Qwen2's forward is exactly that, and Llama's own builds a single full mask.
    forward = Qwen2Model.forward


class CaspLlamaForCausalLM(CaspLlamaPreTrainedModel, LlamaForCausalLM):
    def __init__(self, config: CaspLlamaConfig) -> None:
        CaspLlamaPreTrainedModel.__init__(self, config)
        self.model = CaspLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


CaspLlamaConfig.register_for_auto_class()
CaspLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")
