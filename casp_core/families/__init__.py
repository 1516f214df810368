"""The model families CASP prunes, one module each, and the registry that finds a config's or a layer's family.

`family_of` is the only way casp_core finds family behaviour: nothing outside this package compares model types.
A new family is one module here (a `Family` subclass overriding only what differs from LLaMA) added to FAMILIES,
and its tests (tests/core/families/).
"""

from collections.abc import Iterable
from typing import Any

from torch import nn
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from casp_core.errors import UnsupportedModel
from casp_core.families.base import Family, GgufScales, LayerProjections, RowSlice, projection_parameters
from casp_core.families.gemma import GEMMA2, GEMMA3_TEXT
from casp_core.families.granite import GRANITE
from casp_core.families.llama import LLAMA
from casp_core.families.mistral import MISTRAL
from casp_core.families.mixtral import MIXTRAL
from casp_core.families.olmo2 import OLMO2
from casp_core.families.olmoe import OLMOE
from casp_core.families.phi3 import PHI3
from casp_core.families.qwen2 import QWEN2
from casp_core.families.qwen2_moe import QWEN2_MOE
from casp_core.families.qwen3 import QWEN3
from casp_core.families.qwen3_moe import QWEN3_MOE

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3_TEXT, PHI3, OLMO2, GRANITE)
FAMILIES += (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE)  # the mixtures of experts
# The dense model types CASP prunes.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for family in FAMILIES for t in family.model_types)
_BY_DENSE_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
# A pruned model type belongs to the first family naming it: `casp_llama`, the class Llama, Mistral, Qwen2 and
# Qwen3 share, to Llama, whose settings checks read the pruned config's own switches (qk_norm, biases).
_BY_PRUNED_TYPE = {family.pruned_model_type: family for family in reversed(FAMILIES)}
PRUNED_MODEL_TYPES: tuple[str, ...] = tuple(_BY_PRUNED_TYPE)

# Wherever casp_core is loaded, its own config classes serve the pruned model types (`casp_llama`, ...): otherwise
# AutoTokenizer, which reads the config, asks on stdin whether to run the checkpoint's copy of the modeling file
# (`casp export` of a per-layer checkpoint did), which stalls a worker for 15 s or fails at once off the main thread.
# The model classes are left unregistered, so that AutoModelForCausalLM(trust_remote_code=True) still runs the file
# shipped in the checkpoint, as users will.
for _family in FAMILIES:
    AutoConfig.register(_family.pruned_model_type, _family.pruned_model_class.config_class, exist_ok=True)

__all__ = [
    "FAMILIES",
    "PRUNED_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "Family",
    "GgufScales",
    "LayerProjections",
    "RowSlice",
    "check_export",
    "config_from_dict",
    "family_of",
    "family_of_layer",
    "is_pruned_model_type",
    "projection_parameters",
    "projections",
]


def family_of(config_or_model_type: PretrainedConfig | str | None) -> Family:
    """The family of a dense or pruned config (or of its model_type); UnsupportedModel naming the supported
    types if there is none."""
    model_type = getattr(config_or_model_type, "model_type", config_or_model_type)
    family = None
    if isinstance(model_type, str):  # config.json may hold anything there
        family = _BY_DENSE_TYPE.get(model_type) or _BY_PRUNED_TYPE.get(model_type)
    if family is None:
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported: CASP prunes {', '.join(SUPPORTED_MODEL_TYPES)} models"
        )
    return family


def is_pruned_model_type(model_type: str | None) -> bool:
    """Whether `model_type` is a per-layer checkpoint's (loads with its own modeling file), not a dense family's."""
    return model_type in _BY_PRUNED_TYPE


def family_of_layer(layer: nn.Module) -> Family:
    """A decoder layer's family, from the config its attention module keeps (every transformers attention
    module, and every pruned one, keeps `config`)."""
    return family_of(layer.self_attn.config)


def projections(layer: nn.Module) -> LayerProjections:
    """A decoder layer's seven projections, as its family finds them."""
    return family_of_layer(layer).projections(layer)


def config_from_dict(settings: dict[str, Any]) -> PretrainedConfig:
    """config.json's settings as the config object of its family's class (dense, or the pruned one), which
    computes what the family derives from them (Qwen2's `layer_types`, ...)."""
    model_type = settings.get("model_type")
    family = family_of(model_type)
    if is_pruned_model_type(model_type):
        return family.pruned_model_class.config_class.from_dict(settings)
    return CONFIG_MAPPING[model_type].from_dict(settings)


def check_export(model_config: PretrainedConfig, formats: Iterable[str]) -> None:
    """Refuse (UnsupportedExport), from the dense config alone and so before any work, the export `formats` a job
    asks for (its `export`, or a sweep's format) that the model's family or settings cannot take."""
    if "gguf" in formats:
        family_of(model_config).check_gguf(model_config)
