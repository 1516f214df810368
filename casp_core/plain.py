"""The uniform shape's checkpoint: every decoder layer alike, saved as the source family's own transformers class.

vLLM, TGI and llama.cpp's `llama` architecture serve LlamaForCausalLM (MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM) with no remote code, and nothing with per-layer shapes. What such a class can hold after pruning:

- every layer the same query heads, key/value heads and FFN width, the query heads in equal contiguous groups per
  key/value head (what repeat_kv computes): the uniform budget (casp_core.budget.plan_uniform_shape) keeps that;
- the head counts and biases the family's own config accepts: each family's module says which
  (casp_core.families: Family.allows_head_count, check_plain_shape, plain_config).
"""

from transformers import PretrainedConfig

from casp_core.config import PruneSettings
from casp_core.families import family_of


def check_plain_shape(model_config: PretrainedConfig, settings: PruneSettings) -> None:
    """Refuse, from the config alone, a uniform-shape job whose result the family's own class cannot hold."""
    family_of(model_config).check_plain_shape(model_config, settings)


def allows_head_count(model_config: PretrainedConfig, heads: int) -> bool:
    """Whether the family's config accepts `heads` query heads."""
    return family_of(model_config).allows_head_count(model_config, heads)


def plain_config(
    model_config: PretrainedConfig,
    *,
    heads: int,
    kv_heads: int,
    ffn_width: int,
    head_dim: int,
    attention_bias: bool,
    mlp_bias: bool,
) -> PretrainedConfig:
    """The dense config with the pruned counts: same class, so the same model_type and architectures."""
    return family_of(model_config).plain_config(
        model_config,
        heads=heads,
        kv_heads=kv_heads,
        ffn_width=ffn_width,
        head_dim=head_dim,
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
    )
