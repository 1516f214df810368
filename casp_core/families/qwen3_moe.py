"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) and a mixture of experts (softmax over all experts, top-k,
renormalised when `norm_topk_prob`) in every layer."""

from transformers import PretrainedConfig

from casp_core.errors import UnsupportedModel
from casp_core.families.modeling.modeling_casp_qwen3_moe import CaspQwen3MoeConfig, CaspQwen3MoeForCausalLM
from casp_core.families.moe import MixtureOfExperts


class Qwen3Moe(MixtureOfExperts):
    """The experts' channels are pruned as Mixtral's (casp_core.families.moe); the router's weights, renormalised
    or not, are what the statistics weigh each routed token by. Only models whose every layer is a mixture of
    experts are taken."""

    name = "Qwen3-MoE"
    model_types = ("qwen3_moe",)
    qk_norms = True
    pruned_model_type = CaspQwen3MoeConfig.model_type
    pruned_model_class = CaspQwen3MoeForCausalLM

    expert_width_key = "moe_intermediate_size"

    def check_config(self, model_config: PretrainedConfig) -> None:
        super().check_config(model_config)
        if model_config.mlp_only_layers or model_config.decoder_sparse_step != 1:
            raise UnsupportedModel(
                f"model type {model_config.model_type!r}: dense MLP layers among the mixture-of-experts layers "
                "(mlp_only_layers, decoder_sparse_step) are not supported"
            )


QWEN3_MOE = Qwen3Moe()
