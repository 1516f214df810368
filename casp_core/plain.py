"""The uniform shape's checkpoint: every decoder layer alike, saved as the source family's own transformers class.

vLLM, TGI and llama.cpp's `llama` architecture serve LlamaForCausalLM (MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM) with no remote code, and nothing with per-layer shapes. What such a class can hold after pruning:

- every layer the same query heads, key/value heads and FFN width, the query heads in equal contiguous groups per
  key/value head (what repeat_kv computes): the uniform budget (casp_core.budget.plan_uniform_shape) keeps that;
- LlamaConfig refuses a head count that does not divide hidden_size even when head_dim is set (its
  validate_architecture, through which vLLM reads configs too), so a Llama keeps only such counts;
- biases: mean-bias compensation gives o_proj and down_proj a bias. Llama switches biases per block
  (`attention_bias`: q/k/v/o, `mlp_bias`: gate/up/down), so it carries them beside zero q/k/v/gate/up biases, which
  add exactly 0. Mistral's, Qwen2's and Qwen3's classes have no down_proj bias at all: that combination is refused.
"""

from transformers import PretrainedConfig

from casp_core.config import MEAN_BIAS_COMPENSATION, UNIFORM_SHAPE, PruneSettings
from casp_core.errors import InvalidConfig

# Settings of the dense config that name its class or its files, not the pruned model's shape.
_SOURCE_ONLY_KEYS = ("transformers_version", "_name_or_path")


def check_plain_shape(model_config: PretrainedConfig, settings: PruneSettings) -> None:
    """Refuse, from the config alone, a uniform-shape job whose result the family's own class cannot hold."""
    if settings.shape != UNIFORM_SHAPE or settings.compensation != MEAN_BIAS_COMPENSATION:
        return
    if model_config.model_type != "llama":
        family = (model_config.architectures or [model_config.model_type])[0]
        raise InvalidConfig(
            f"compensation: bias puts a bias on o_proj and down_proj, which {family} has not, so shape uniform "
            "cannot save it as a plain checkpoint; use shape per_layer or another compensation"
        )


def allows_head_count(model_config: PretrainedConfig, heads: int) -> bool:
    """Whether the family's config accepts `heads` query heads (LlamaConfig: only divisors of hidden_size)."""
    return heads > 0 and (model_config.model_type != "llama" or model_config.hidden_size % heads == 0)


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
    settings = {k: v for k, v in model_config.to_dict().items() if k not in _SOURCE_ONLY_KEYS}
    settings.update(
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn_width, head_dim=head_dim
    )
    if model_config.model_type == "llama":
        settings.update(attention_bias=attention_bias, mlp_bias=mlp_bias)
    return type(model_config)(**settings)
