"""Granite 3 (model_type `granite`): LLaMA's layout with an embedding, an attention, a residual and a logits
multiplier."""

from casp_core.families.base import Family
from casp_core.modeling_casp_granite import CaspGraniteConfig, CaspGraniteForCausalLM


class Granite(Family):
    """Differs from LLaMA in four multipliers, none of which stands in the way of pruning: the embedding multiplier
    and the logits scaling act outside the layers, the attention multiplier (the scale in place of 1/sqrt(head_dim))
    acts within each head, and the residual multiplier scales o_proj's and down_proj's outputs, to which a removed
    unit, like a masked one, contributes nothing. Heads and channels are pruned as in LLaMA; the per-layer class
    (casp_core.modeling_casp_granite) is Granite's own with the LLaMA-family pruned attention and MLP."""

    name = "Granite 3"
    model_types = ("granite",)
    pruned_model_type = CaspGraniteConfig.model_type
    pruned_model_class = CaspGraniteForCausalLM
    # GraniteConfig takes any head count with an explicit head_dim (its attention reads head_dim).
    plain_heads_divide_hidden = False
    gguf = None
    gguf_refusal = (
        "llama.cpp's deci architecture, the one that takes per-layer head counts and FFN widths, has none of "
        "Granite's embedding, attention, residual and logits multipliers; use the safetensors checkpoint "
        "(shape: uniform gives GraniteForCausalLM, which loads without remote code)"
    )


GRANITE = Granite()
