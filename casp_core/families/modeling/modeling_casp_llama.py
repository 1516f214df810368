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

import inspect

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen2.modeling_qwen2 import Qwen2Model
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention


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


# transformers 5.24 renamed the attention's cache argument from `past_key_values` to `cache` (the decoder layer passes
# it by name): the installed version's own attention says which name it reads.
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(Qwen3Attention.forward).parameters else "past_key_values"


class KeyValueGather:
    """Stands in for the cache in the upstream attention's forward on a layer whose query heads read their key/value
    heads in uneven groups: the cache (if any) stores only the kept key/value heads, and attention is handed one
    key/value head per query head, after which every group has size 1."""

    def __init__(self, cache: Cache | None, kv_of_query: list[int]) -> None:
        self.cache = cache
        self.kv_of_query = kv_of_query

    def update(self, key: torch.Tensor, value: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cache is not None:
            key, value = self.cache.update(key, value, *args, **kwargs)
        index = torch.tensor(self.kv_of_query, device=key.device)
        return key.index_select(1, index), value.index_select(1, index)


class CaspLlamaAttention(Qwen3Attention):
    """Qwen3's attention is Llama's plus the two things some families need: per-head q/k norms (identities where the
    family has none) and the layer's own sliding window. Only the head counts and the biases differ, so only
    `__init__` is new; `forward` is upstream's, except on the two layer shapes upstream cannot express: uneven
    key/value groups (repeat_kv needs equal contiguous groups) and a layer that kept no head."""

    def __init__(self, config: CaspLlamaConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
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
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        bias = config.attention_qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_o_bias)
        # Qwen3's norms are over head_dim and shared by all heads of the layer, so removing heads leaves them whole.
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.num_heads == 0:
            return self.forward_without_heads(hidden_states, kwargs.get(CACHE_ARGUMENT))
        if self.gather_kv:
            kwargs[CACHE_ARGUMENT] = KeyValueGather(kwargs.get(CACHE_ARGUMENT), self.kv_of_query)
        return super().forward(hidden_states, **kwargs)

    def forward_without_heads(self, hidden_states: torch.Tensor, cache: Cache | None) -> tuple[torch.Tensor, None]:
        """o_proj's bias (or zeros): no head is left to attend."""
        input_shape = hidden_states.shape[:-1]
        if cache is not None:
            # transformers reads the cached length from the entries and counts an empty one as 0: a one-channel
            # placeholder keeps the positions of later tokens right.
            placeholder = hidden_states.new_zeros(*input_shape[:-1], 1, input_shape[-1], 1)
            cache.update(placeholder, placeholder, self.layer_idx)
        return self.o_proj(hidden_states.new_zeros(*input_shape, 0)), None


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
