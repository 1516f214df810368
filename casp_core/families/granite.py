"""Granite 3 (model_type `granite`): LLaMA's layout with an embedding, an attention, a residual and a logits
multiplier."""

import math

from transformers import PretrainedConfig

from casp_core.families.base import Family, GgufScales
from casp_core.families.modeling.modeling_casp_granite import CaspGraniteConfig, CaspGraniteForCausalLM


class Granite(Family):
    """Differs from LLaMA in four multipliers, none of which stands in the way of pruning: the embedding multiplier
    and the logits scaling act outside the layers, the attention multiplier (the scale in place of 1/sqrt(head_dim))
    acts within each head, and the residual multiplier scales o_proj's and down_proj's outputs, to which a removed
    unit, like a masked one, contributes nothing. Heads and channels are pruned as in LLaMA; the per-layer class
    (casp_core.families.modeling.modeling_casp_granite) is Granite's own with the LLaMA-family pruned attention and MLP.

    GGUF: llama.cpp's granite architecture applies the multipliers but takes one head count and FFN width for all
    layers; its deci architecture takes them per layer but has no multipliers. Each multiplier is linear in a
    weight, so the writer folds them in (`gguf_scales`) and writes deci (or llama, where every layer is alike),
    which then computes what Granite computes.
    """

    name = "Granite 3"
    model_types = ("granite",)
    pruned_model_type = CaspGraniteConfig.model_type
    pruned_model_class = CaspGraniteForCausalLM
    # GraniteConfig takes any head count with an explicit head_dim (its attention reads head_dim).
    plain_heads_divide_hidden = False

    def gguf_scales(self, model_config: PretrainedConfig) -> GgufScales:
        """The embeddings times `embedding_multiplier`; q_proj's rows times `attention_multiplier * sqrt(head_dim)`
        (llama.cpp scales scores by 1/sqrt(head_dim), Granite by the multiplier; RoPE is linear in q); o_proj's and
        down_proj's weights and biases times `residual_multiplier`; the head divided by `logits_scaling`."""
        head_dim = (
            getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
        )
        return GgufScales(
            embedding=model_config.embedding_multiplier,
            query=model_config.attention_multiplier * math.sqrt(head_dim),
            sublayer_output=model_config.residual_multiplier,
            logits=1.0 / model_config.logits_scaling,
        )


GRANITE = Granite()
