"""Qwen2-MoE: Qwen2's attention (q/k/v biases) and a mixture of experts (softmax over all experts, top-k,
renormalised when `norm_topk_prob`) beside a shared expert, a dense MLP every token goes through, scaled by its own
sigmoid gate, in every layer."""

from transformers import PretrainedConfig

from casp_core.errors import UnsupportedModel
from casp_core.families.base import Family
from casp_core.families.modeling.modeling_casp_qwen2_moe import CaspQwen2MoeConfig, CaspQwen2MoeForCausalLM
from casp_core.families.moe import MixtureOfExperts


class Qwen2Moe(MixtureOfExperts):
    """The experts' channels are pruned as Mixtral's (casp_core.families.moe). The shared expert's channels are units
    as well: it is one more expert, numbered after the routed ones, that every token reaches with the weight
    σ(shared_expert_gate x), so its statistics and its share of the layer's channels follow the same rules. Only
    models whose every layer is a mixture of experts are taken."""

    name = "Qwen2-MoE"
    model_types = ("qwen2_moe",)
    pruned_model_type = CaspQwen2MoeConfig.model_type
    pruned_model_class = CaspQwen2MoeForCausalLM

    expert_width_key = "moe_intermediate_size"
    # The shared expert is a dense MLP of nn.Linear projections named as LLaMA's: LoRA adapts them as modules.
    lora_targets = Family.lora_targets

    def shared_expert_width(self, model_config: PretrainedConfig) -> int:
        return model_config.shared_expert_intermediate_size

    def width_settings(self, widths: list[tuple[int, ...]]) -> dict[str, list]:
        """The routed experts' widths and, apart, the shared expert's (the last of each layer's widths)."""
        return {
            "layer_expert_intermediate_sizes": [list(layer_widths[:-1]) for layer_widths in widths],
            "layer_shared_expert_intermediate_sizes": [layer_widths[-1] for layer_widths in widths],
        }

    def check_config(self, model_config: PretrainedConfig) -> None:
        super().check_config(model_config)
        if model_config.mlp_only_layers or model_config.decoder_sparse_step != 1:
            raise UnsupportedModel(
                f"model type {model_config.model_type!r}: dense MLP layers among the mixture-of-experts layers "
                "(mlp_only_layers, decoder_sparse_step) are not supported"
            )


QWEN2_MOE = Qwen2Moe()
