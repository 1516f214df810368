"""OLMo 2: LLaMA's projections, post-norms, and q/k norms over the whole projection; only FFN channels are pruned."""

from transformers import PretrainedConfig, PreTrainedModel

from casp_core.errors import VerificationFailed
from casp_core.families.base import Family
from casp_core.families.modeling.modeling_casp_olmo2 import CaspOlmo2Config, CaspOlmo2ForCausalLM


class Olmo2(Family):
    """Differs from LLaMA in its norms. Each layer normalises after attention and after the MLP
    (`post_attention_layernorm`, `post_feedforward_layernorm`, no input norm), and normalises the queries and the
    keys with one RMSNorm over the whole q (k) projection, `num_heads * head_dim` wide, before splitting it into
    heads.

    That q/k norm is why no head is pruned (`prunes_heads = False`). Removing a head changes the root mean square
    that scales every other head's query and key, so a model without the head does not compute what the dense
    model with the head masked (its o_proj columns zeroed) computes, and the masked model is what calibration,
    compensation and verification measure. issue 25 allowed the other choice, a reference that normalises over
    the kept heads measured against the dense model; FFN channels alone keep pruned == masked exact, and the
    budget then comes from the MLP alone (about two thirds of a layer's projections), so a ratio above the
    MLP's share is refused before any work.

    The post-norms are no obstacle: a channel's only path to the output is its down_proj column, and the norm
    after the MLP sees down_proj's output unchanged. Every norm is carried whole (the base does that).
    """

    name = "OLMo 2"
    model_types = ("olmo2",)
    pruned_model_type = CaspOlmo2Config.model_type
    pruned_model_class = CaspOlmo2ForCausalLM
    prunes_heads = False
    qk_norms = True  # and its two hidden-state norms come after attention and after the MLP
    # Olmo2Config has one bias switch for q/k/v/o and none for the MLP: mean-bias compensation's down_proj bias
    # has no place in the family's own class.
    plain_bias_switches = False
    # Heads stay, so any count the dense config has is the uniform shape's.
    plain_heads_divide_hidden = False
    gguf = None
    gguf_refusal = (
        "llama.cpp's deci architecture, the one that takes per-layer FFN widths, has no post-norms and no q/k "
        "norms; use the safetensors checkpoint (shape: uniform gives Olmo2ForCausalLM, which loads without "
        "remote code)"
    )

    def pruned_config(
        self, model: PreTrainedModel, kv_maps: list[list[int]], widths: list[int], head_dim: int
    ) -> PretrainedConfig:
        """The dense settings and each layer's FFN width; attention keeps the dense settings whole."""
        heads = model.config.num_attention_heads
        if any(len(kv_map) != heads for kv_map in kv_maps):
            raise VerificationFailed(f"{self.name} keeps every attention head, and the pruning removed some")
        settings = {k: v for k, v in model.config.to_dict().items() if k not in self.dense_only_keys}
        projections = self.projections(model.model.layers[0])
        settings.update(
            attention_o_bias=projections.o.bias is not None,
            mlp_down_bias=projections.down.bias is not None,
            layer_intermediate_sizes=widths,
            casp=settings.get("casp"),
            architectures=[self.pruned_model_class.__name__],
        )
        return CaspOlmo2Config(**settings)


OLMO2 = Olmo2()
