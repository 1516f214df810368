"""Mixtral: LLaMA's attention and a mixture of experts (softmax over all experts, top-k, renormalised) in each layer."""

from casp_core.families.modeling.modeling_casp_mixtral import CaspMixtralConfig, CaspMixtralForCausalLM
from casp_core.families.moe import MixtureOfExperts


class Mixtral(MixtureOfExperts):
    """The experts' channels are pruned (casp_core.families.moe); the pruned class gives each expert its own width
    (casp_core.families.modeling.modeling_casp_mixtral)."""

    name = "Mixtral"
    model_types = ("mixtral",)
    pruned_model_type = CaspMixtralConfig.model_type
    pruned_model_class = CaspMixtralForCausalLM
    expert_count_key = "num_local_experts"


MIXTRAL = Mixtral()
