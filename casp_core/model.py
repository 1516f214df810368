"""Model adapter: loads a LLaMA-family causal LM and names the parts CASP prunes.

A decoder layer has attention (q/k/v/o_proj; units are query heads, blocks of `head_dim` input columns of
o_proj) and a gated MLP (gate/up/down_proj; units are intermediate channels, input columns of down_proj).
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from casp_core.errors import ModelNotFound, UnsupportedModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AttentionGeometry:
    """Which key/value head each query head reads (`kv_of_query[q]`), and the head size."""

    head_dim: int
    kv_of_query: tuple[int, ...]
    num_kv_heads: int

    @property
    def num_heads(self) -> int:
        return len(self.kv_of_query)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_model_reference(name_or_path: str) -> None:
    """A Hugging Face id is `org/name`; anything that starts like a path must be a local directory."""
    if name_or_path.startswith((".", "/", "~")) and not Path(name_or_path).expanduser().is_dir():
        raise ModelNotFound(f"model path {name_or_path!r} does not exist or is not a directory")


def load_model(
    name_or_path: str, *, revision: str | None = None, dtype: str = "auto"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load weights on the CPU; the pipeline moves one decoder layer at a time to the accelerator."""
    check_model_reference(name_or_path)
    try:
        config = AutoConfig.from_pretrained(name_or_path, revision=revision)
    except OSError as error:
        raise ModelNotFound(f"cannot load model {name_or_path!r}: {error}") from error
    check_supported_config(config)
    torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
    model = AutoModelForCausalLM.from_pretrained(name_or_path, revision=revision, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision)
    model.eval()
    check_supported(model)
    return model, tokenizer


def check_supported_config(config: object) -> None:
    model_type = getattr(config, "model_type", None)
    missing = [
        name
        for name in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size")
        if getattr(config, name, None) is None
    ]
    if missing:
        raise UnsupportedModel(
            f"model type {model_type!r} is not a LLaMA-family decoder: its config has no {', '.join(missing)}"
        )


def check_supported(model: nn.Module) -> None:
    """LLaMA layout: model.model.layers[i].self_attn.{q,k,v,o}_proj and .mlp.{gate,up,down}_proj."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) == 0:
        raise UnsupportedModel(
            f"{type(model).__name__} is not supported: expected decoder layers at model.model.layers"
        )
    layer = layers[0]
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    missing = [f"self_attn.{p}" for p in ATTENTION_PARTS if not isinstance(getattr(attention, p, None), nn.Linear)]
    missing += [f"mlp.{p}" for p in MLP_PARTS if not isinstance(getattr(mlp, p, None), nn.Linear)]
    if missing:
        raise UnsupportedModel(
            f"{type(model).__name__} is not supported: its decoder layers have no {', '.join(missing)} "
            "(CASP needs the LLaMA layout)"
        )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def attention_geometry(model: PreTrainedModel, layer: nn.Module) -> AttentionGeometry:
    """Read from the layer itself when it is already pruned, else from the model's config."""
    attention = layer.self_attn
    kv_of_query = getattr(attention, "kv_of_query", None)
    head_dim = attention.head_dim
    if kv_of_query is not None:
        return AttentionGeometry(head_dim, tuple(kv_of_query), attention.k_proj.out_features // head_dim)
    num_heads = attention.q_proj.out_features // head_dim
    num_kv_heads = attention.k_proj.out_features // head_dim
    group = num_heads // num_kv_heads
    return AttentionGeometry(head_dim, tuple(q // group for q in range(num_heads)), num_kv_heads)


def sublayer_parameters(layer: nn.Module) -> tuple[int, int]:
    """Parameters of (attention, MLP) projections: what the pruning ratio is measured against."""
    attention = sum(p.numel() for name in ATTENTION_PARTS for p in getattr(layer.self_attn, name).parameters())
    mlp = sum(p.numel() for name in MLP_PARTS for p in getattr(layer.mlp, name).parameters())
    return attention, mlp


def prunable_parameters(model: nn.Module) -> int:
    return sum(sum(sublayer_parameters(layer)) for layer in decoder_layers(model))
