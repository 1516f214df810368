"""What a file's size needs of a model, as plain numbers: its geometry (`Geometry.of` a dense model, real or built on
the meta device) and the shape pruning leaves, layer by layer. casp_core.job.sweep.shapes plans the shape;
casp_core.artifacts.gguf.size and casp_core.artifacts.compressed_tensors.size turn it into bytes."""

from dataclasses import dataclass

from transformers import PreTrainedModel

from casp_core.families import projections
from casp_core.model import attention_geometry, decoder_layers, sublayer_parameters

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Geometry:
    """What the files' sizes need of a dense model besides its pruned shape."""

    hidden: int
    head_dim: int
    vocab: int
    layers: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    other_params: int  # embedding, head and norms: everything the pruning leaves whole
    dtype_bytes: int

    @classmethod
    def of(cls, model: PreTrainedModel, dtype: str) -> "Geometry":
        layers = decoder_layers(model)
        parts = projections(layers[0])
        config = model.config
        stored = getattr(config, "dtype", None) or "float32"
        name = dtype if dtype != "auto" else str(stored).removeprefix("torch.")
        return cls(
            hidden=config.hidden_size,
            head_dim=attention_geometry(model, layers[0]).head_dim,
            vocab=config.vocab_size,
            layers=len(layers),
            tied=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            qkv_bias=parts.q.bias is not None,
            o_bias=parts.o.bias is not None,
            mlp_bias=parts.down.bias is not None,
            other_params=dense_params(model) - sum(sum(sublayer_parameters(layer)) for layer in layers),
            dtype_bytes=DTYPE_BYTES.get(name, 4),
        )

    def projection_params(self, shape: "LayerShape") -> int:
        """A layer's attention and MLP projections, biases included, in `shape`."""
        h, d = self.hidden, self.head_dim
        q, kv, w = shape.heads * d, shape.kv_heads * d, shape.ffn_width
        attention = (q + 2 * kv) * (h + self.qkv_bias) + h * q + self.o_bias * h
        return attention + 2 * w * (h + self.mlp_bias) + h * w + self.mlp_bias * h


@dataclass(frozen=True)
class LayerShape:
    heads: int  # query heads kept
    kv_heads: int  # key/value heads kept
    gguf_kv_heads: int  # key/value heads as the GGUF writes them (repeated where groups are uneven)
    ffn_width: int  # FFN channels kept


@dataclass(frozen=True)
class PlannedShape:
    layers: tuple[LayerShape, ...]
    params: int  # every parameter the pruned model holds (tied ones once)


def dense_params(model: PreTrainedModel) -> int:
    return sum(parameter.numel() for parameter in model.parameters())
