"""Gemma 2 and Gemma 3 (text): LLaMA's units inside Gemma's layer.

The units are LLaMA's: query heads (head_dim rows of q_proj, the same columns of o_proj), key/value heads leaving
with their last query head, FFN channels (rows of gate_proj and up_proj, columns of down_proj). What Gemma adds
around them is kept whole by the base surgery, which carries every other parameter of the layer: the four norms
(before and after attention and the MLP) and Gemma 3's q/k norms over head_dim, shared by the heads. Masking a unit
zeroes its o_proj/down_proj columns before the post-norm, and the pruned layer computes the same sum before the
same post-norm, so pruned equals masked exactly. The pruned checkpoint is
casp_core/families/modeling/modeling_casp_gemma.py.
"""

from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from casp_core.errors import UnsupportedModel
from casp_core.families.base import Family
from casp_core.families.modeling.modeling_casp_gemma import (
    CaspGemma2Config,
    CaspGemma2ForCausalLM,
    CaspGemma3ForCausalLM,
    CaspGemma3TextConfig,
)

_GGUF_REFUSAL = (
    "casp's GGUF writer writes llama.cpp's llama and deci architectures, which have no post-norms, soft-capping or "
    "scaled embedding, and not llama.cpp's {arch}; use shape uniform without the gguf export and convert its "
    "checkpoint ({cls}) with llama.cpp's convert_hf_to_gguf.py, or serve the safetensors checkpoint"
)


class Gemma2(Family):
    """Differs from LLaMA in settings the pruned class carries and the base reads unchanged (head_dim, layer_types,
    biases), and in what the family's own config and llama.cpp accept:
    - Gemma2Config has one bias switch for q/k/v/o and none for the MLP, so the uniform shape cannot hold mean-bias
      compensation's down_proj bias; like LlamaConfig it asks hidden_size to be a multiple of the head count;
    - `use_bidirectional_attention` (EmbeddingGemma's encoder) makes it no causal LM: refused."""

    name = "Gemma 2"
    model_types = ("gemma2",)
    pruned_model_type = CaspGemma2Config.model_type
    pruned_model_class = CaspGemma2ForCausalLM
    plain_bias_switches = False
    plain_heads_divide_hidden = True
    hidden_norms = 4  # before and after attention, before and after the MLP
    gguf = None
    gguf_refusal = _GGUF_REFUSAL.format(arch="gemma2", cls="Gemma2ForCausalLM")

    def check_config(self, model_config: PretrainedConfig) -> None:
        super().check_config(model_config)
        if getattr(model_config, "use_bidirectional_attention", None):
            raise UnsupportedModel(
                f"model type {model_config.model_type!r}: use_bidirectional_attention (an encoder, not a causal LM) "
                "is not supported"
            )


class Gemma3Text(Gemma2):
    """Gemma 3's text model (Gemma3ForCausalLM: Gemma 3 1B, or the text part saved on its own; the multimodal
    `gemma3` is another model type). Differs from Gemma 2 in its modeling only (no soft-capping, q/k norms, rope per
    layer type), which the pruned class carries, and in its rope settings, one per layer type, each checked."""

    name = "Gemma 3"
    model_types = ("gemma3_text",)
    pruned_model_type = CaspGemma3TextConfig.model_type
    pruned_model_class = CaspGemma3ForCausalLM
    qk_norms = True
    gguf_refusal = _GGUF_REFUSAL.format(arch="gemma3", cls="Gemma3ForCausalLM")

    def check_config(self, model_config: PretrainedConfig) -> None:
        super().check_config(model_config)
        for layer_type, rope in (getattr(model_config, "rope_parameters", None) or {}).items():
            rope_type = (rope or {}).get("rope_type", "default")
            if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
                raise UnsupportedModel(
                    f"model type {model_config.model_type!r}: rope type {rope_type!r} of the {layer_type} layers is "
                    "not supported"
                )


GEMMA2 = Gemma2()
GEMMA3_TEXT = Gemma3Text()
