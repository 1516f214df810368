"""An OLMo 2 whose decoder layers each keep their own FFN width; attention heads stay whole.

This file is copied into every pruned OLMo 2 checkpoint and named in its `auto_map`, so it imports only torch,
transformers and (relatively, which transformers copies along) `modeling_casp_llama`. Per layer `l` the config
records `layer_intermediate_sizes[l]`.

Why heads stay whole: OLMo 2 normalises queries and keys with one RMSNorm over the whole q (and k) projection,
`num_heads * head_dim` wide, before splitting it into heads. Removing a head changes the root mean square that
scales every other head's query and key, so a model without the head cannot compute what the dense model with
that head's o_proj columns masked computes, and no weight of the smaller model makes up for it. casp prunes only
FFN channels of OLMo 2 (its family says `prunes_heads = False`), which stays exact: a channel's only path to the
output is its column of down_proj, and the norm after the MLP (`post_feedforward_layernorm`) sees down_proj's
output unchanged.

What differs from OLMo 2's own classes, and nothing else:
- the MLP's width per layer (and a down_proj bias for FLAP's mean-bias compensation): Llama's MLP, which is OLMo
  2's with bias switches, as the Llama-family pruned model already builds it;
- an o_proj bias apart from q/k/v (mean-bias compensation gives o_proj one; OLMo 2's `attention_bias` switches all
  four together).
"""

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import Olmo2Config
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.olmo2.modeling_olmo2 import (
    Olmo2Attention,
    Olmo2DecoderLayer,
    Olmo2ForCausalLM,
    Olmo2Model,
    Olmo2PreTrainedModel,
    Olmo2RMSNorm,
    Olmo2RotaryEmbedding,
)

from .modeling_casp_llama import CaspLlamaMLP


@strict
class CaspOlmo2Config(Olmo2Config):
    model_type = "casp_olmo2"
    # OLMo 2's MLP has no biases; CaspLlamaMLP reads this switch for gate_proj and up_proj.
    mlp_bias = False

    # transformers 5.4's Olmo2Config declares this `int`, and huggingface_hub's strict dataclasses then refuse the
    # `false` every OLMo 2 config.json holds (5.24 declares it `bool`): declared here as it is meant, so that pruned
    # checkpoints load under every transformers the project supports.
    tie_word_embeddings: bool = False

    layer_intermediate_sizes: list | None = None
    # None: `attention_bias`, OLMo 2's one switch for q/k/v/o.
    attention_o_bias: bool | None = None
    mlp_down_bias: bool = False  # FLAP's mean-bias compensation adds a bias to down_proj
    casp: dict | None = None  # provenance: the dense model, the pruning settings

    def __post_init__(self, **kwargs) -> None:
        if self.attention_o_bias is None:
            self.attention_o_bias = self.attention_bias
        if self.layer_intermediate_sizes is None:
            self.layer_intermediate_sizes = [self.intermediate_size] * self.num_hidden_layers
        super().__post_init__(**kwargs)


class CaspOlmo2Attention(Olmo2Attention):
    """OLMo 2's attention, heads and q/k norms whole; only o_proj's bias may differ from q/k/v's."""

    def __init__(self, config: CaspOlmo2Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        if config.attention_o_bias != config.attention_bias:
            self.o_proj = nn.Linear(self.o_proj.in_features, config.hidden_size, bias=config.attention_o_bias)


class CaspOlmo2DecoderLayer(Olmo2DecoderLayer):
    """OLMo 2's post-norm layer (no input norm; a norm after attention and one after the MLP) with its own width.
    `__init__` is new so that the dense-width MLP is never built; `forward` is upstream's."""

    def __init__(self, config: CaspOlmo2Config, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = CaspOlmo2Attention(config, layer_idx)
        self.mlp = CaspLlamaMLP(config, config.layer_intermediate_sizes[layer_idx])
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class CaspOlmo2PreTrainedModel(Olmo2PreTrainedModel):
    config_class = CaspOlmo2Config
    config: CaspOlmo2Config
    _no_split_modules = ["CaspOlmo2DecoderLayer"]
    _can_record_outputs = {"hidden_states": CaspOlmo2DecoderLayer, "attentions": CaspOlmo2Attention}


class CaspOlmo2Model(CaspOlmo2PreTrainedModel, Olmo2Model):
    """OLMo 2's model with the per-layer decoder layers; `forward` is upstream's."""

    def __init__(self, config: CaspOlmo2Config) -> None:
        CaspOlmo2PreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [CaspOlmo2DecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = Olmo2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Olmo2RotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class CaspOlmo2ForCausalLM(CaspOlmo2PreTrainedModel, Olmo2ForCausalLM):
    def __init__(self, config: CaspOlmo2Config) -> None:
        CaspOlmo2PreTrainedModel.__init__(self, config)
        self.model = CaspOlmo2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


CaspOlmo2Config.register_for_auto_class()
CaspOlmo2ForCausalLM.register_for_auto_class("AutoModelForCausalLM")
