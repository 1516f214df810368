"""OLMoE: OLMo's attention (q/k norms over all heads) and a mixture of experts (softmax over all experts, top-k,
renormalised when `norm_topk_prob`) in every layer."""

from casp_core.families.modeling.modeling_casp_olmoe import CaspOlmoeConfig, CaspOlmoeForCausalLM
from casp_core.families.moe import MixtureOfExperts


class Olmoe(MixtureOfExperts):
    """The experts' channels are pruned as Mixtral's (casp_core.families.moe). Its q/k norms span every head, as
    OLMo 2's do, which would forbid pruning heads; a mixture of experts keeps its heads anyway."""

    name = "OLMoE"
    model_types = ("olmoe",)
    qk_norms = True
    pruned_model_type = CaspOlmoeConfig.model_type
    pruned_model_class = CaspOlmoeForCausalLM


OLMOE = Olmoe()
