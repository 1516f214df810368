"""Checkpoints: a Hugging Face directory with per-layer shapes in config.json and the modeling file in auto_map.

It loads offline with `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` and with
`load_pruned(path)`. Without trust_remote_code, in a process that has not imported casp_core, transformers
refuses the unknown `casp_llama` model type (or another family's pruned type) rather than loading a dense model
with wrong shapes.

A uniform-shape result (`shape: uniform`) is the source family's own class (LlamaForCausalLM, ...): its
config.json has no auto_map, the directory no modeling file, and it loads with plain
`AutoModelForCausalLM.from_pretrained(path)`.
"""

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from casp_core.errors import ModelNotFound
from casp_core.families import family_of, is_pruned_model_type


def save_pruned(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Weights as safetensors, the config (a per-layer class's with auto_map and a copy of its modeling file,
    modeling_casp_llama.py for the LLaMA-layout families), the tokenizer."""
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def load_pruned(path: str | Path, *, dtype: str = "auto") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The project's own loader: the class comes from casp_core, not from the file in the checkpoint (a
    uniform-shape checkpoint's is transformers' own)."""
    if not (Path(path) / "config.json").is_file():
        raise ModelNotFound(f"{path} is not a checkpoint directory (no config.json)")
    model_type = AutoConfig.from_pretrained(path).model_type
    if is_pruned_model_type(model_type):
        model = family_of(model_type).pruned_model_class.from_pretrained(path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer
