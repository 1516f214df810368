"""GGUF export for llama.cpp (and Ollama, LM Studio): dense and pruned checkpoints, the tokenizer inside.

A pruned checkpoint keeps its own query heads, key/value heads and FFN width per layer. llama.cpp's `deci`
architecture takes exactly that: per-layer arrays for `head_count`, `head_count_kv` and `feed_forward_length`.
A checkpoint whose layers are all alike (a dense one) is written as plain `llama`. What llama.cpp needs on top:

- RoPE: transformers rotates the two halves of each head (rotate_half), llama.cpp rotates adjacent pairs, so
  each q/k head's rows are permuted as llama.cpp's converter does, with the layer's own head counts.
- Grouped-query attention: llama.cpp reads query head h from key/value head h // (heads / kv_heads). Pruning
  leaves groups of any size in any order, so query heads are reordered by their key/value head (o_proj columns
  follow) and each key/value head is written once per G query heads it serves, G the greatest common divisor of
  the group sizes: the same function, more KV cache only where groups are uneven.
- A layer without heads is written without attention tensors (llama.cpp skips attention where head_count is 0),
  except the first: llama.cpp takes the head size of every layer from layer 0's head count, so a first layer
  without heads gets one head of zeros (its output is exactly 0).
  A layer without FFN channels gets one channel of zeros: llama.cpp's deci graph drops the attention output of
  a layer with feed_forward_length 0 (it is meant for layers that have neither).
- A family's multipliers that llama.cpp's graphs lack (Granite's) are folded into the weights they scale
  (Family.gguf_scales); a tied head whose embedding is scaled is written as a tensor of its own.
- Sliding-window attention (Mistral, Qwen2) has no deci counterpart; within the window it equals full attention,
  so the file's context length is capped at the window.
- The quantized types (q8_0, the K-quants, q4_0, q5_0, iq4_nl) are made by llama.cpp's own quantizer
  (`llama_model_quantize`, its default parameters: the type mix of `llama-quantize`) from an F32 file written
  first and removed after, for any hidden size. A weight whose rows are not a multiple of its type's block gets
  llama.cpp's fallback type (Q2_K and Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; F16 where no
  32-block fits), as in llama.cpp's own quantization of such a model; the types are read back from the file
  written, and every tensor whose type is not the one the mix gives it is named in `GgufExport.fallbacks`.
"""

import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf
import torch
from safetensors import safe_open

from casp_core.artifacts.gguf.tokenizer import read_vocabulary, write_vocabulary
from casp_core.artifacts.gguf.types import GGML_BLOCKS, Tensor, is_quantized, llama_cpp_types, require_llama_cpp
from casp_core.errors import CaspError, InvalidConfig, ModelNotFound, UnsupportedExport
from casp_core.families import Family, GgufScales, check_export, config_from_dict, family_of, is_pruned_model_type
from casp_core.settings import GGUF_TYPES

_FLOAT = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
}
_FILE_TYPE = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
}


class QuantizationFailed(CaspError):
    """llama.cpp's quantizer returned an error (its log says which, on stderr)."""

    code = "quantization_failed"


@dataclass(frozen=True)
class Fallback:
    """A weight that did not get its type in the quantized mix because its rows (`row_length` weights, the
    weight's input width) are not a multiple of that type's block."""

    tensor: str
    type: str  # what it got: llama.cpp's fallback type for `wanted`, or F16 where no 32-block fits either
    wanted: str  # what the mix gives a weight of whole blocks there
    row_length: int
    block: int  # the weights in one block of `wanted`


@dataclass(frozen=True)
class GgufExport:
    """What was written: the file, its digest, each tensor's GGML type (read back from the file) and what
    deviates from the request."""

    path: Path
    sha256: str
    architecture: str  # "llama" when every layer has the same shape, else "deci"
    gguf_type: str
    tensor_types: dict[str, str]
    fallbacks: tuple[Fallback, ...] = ()  # weights whose rows did not fit their quantized type's block
    bits_per_weight: float = 0.0  # llama.cpp's BPW: its model size (the tensors' bytes) x 8 over its parameters
    bytes: int = 0  # the file's size
    kv_repeated_layers: tuple[int, ...] = ()  # layers whose key/value heads are repeated for uneven groups
    context_length: int = 0
    tokenizer_caveat: str | None = None  # what llama.cpp's tokenizer cannot reproduce, if anything

    def summary(self) -> dict[str, Any]:
        """For the command's JSON line and the report: the count of each tensor type, not the per-tensor list
        (hundreds of entries)."""
        fields = asdict(self)
        fields["tensor_types"] = dict(Counter(self.tensor_types.values()).most_common())
        return {**fields, "path": str(self.path)}


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer as the checkpoint stores it."""

    kv_of_query: tuple[int, ...]  # for each query head, the key/value head it reads
    num_kv_heads: int
    ffn_width: int


@dataclass(frozen=True)
class AttentionLayout:
    """How llama.cpp gets one layer's attention: query heads in this order, these key/value heads (repeats)."""

    query_order: tuple[int, ...]
    kv_heads: tuple[int, ...]

    @property
    def repeated(self) -> bool:
        return len(self.kv_heads) != len(set(self.kv_heads))


def attention_layout(shape: LayerShape) -> AttentionLayout:
    """Query heads grouped by key/value head; each key/value head written once per G of its query heads."""
    if not shape.kv_of_query:
        return AttentionLayout((), ())
    groups = {kv: [q for q, k in enumerate(shape.kv_of_query) if k == kv] for kv in sorted(set(shape.kv_of_query))}
    group = math.gcd(*(len(queries) for queries in groups.values()))
    query_order = tuple(q for queries in groups.values() for q in queries)
    kv_heads = tuple(kv for kv, queries in groups.items() for _ in range(len(queries) // group))
    return AttentionLayout(query_order, kv_heads)


def _rope_pairs(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per head, rotate_half order (first half, second half) to llama.cpp's interleaved pairs."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, 2, head_dim // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _heads(rows: torch.Tensor, head_dim: int, order: tuple[int, ...]) -> torch.Tensor:
    """Rows of the listed heads, in that order (a head may repeat)."""
    per_head = rows.reshape(-1, head_dim, *rows.shape[1:])
    return per_head[list(order)].reshape(len(order) * head_dim, *rows.shape[1:])


class _Checkpoint:
    """config.json and the safetensors weights (one file or shards), read lazily by name."""

    def __init__(self, directory: Path) -> None:
        if not (directory / "config.json").is_file():
            raise ModelNotFound(f"{directory} is not a checkpoint directory (no config.json)")
        self.directory = directory
        self.config: dict[str, Any] = json.loads((directory / "config.json").read_text())
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: directory / file for name, file in weight_map.items()}
        elif (directory / "model.safetensors").is_file():
            with safe_open(directory / "model.safetensors", framework="pt") as weights:
                files = {name: directory / "model.safetensors" for name in weights.keys()}  # noqa: SIM118
        else:
            raise ModelNotFound(f"{directory} holds no safetensors weights")
        self.files = files
        self.unread = {name for name in files if not name.endswith("rotary_emb.inv_freq")}

    def has(self, name: str) -> bool:
        return name in self.files

    def tensor(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only its rows `rows[0]` to `rows[1]` (read alone from the file)."""
        self.unread.discard(name)
        with safe_open(self.files[name], framework="pt") as weights:
            if rows is None:
                return weights.get_tensor(name).to(torch.float32)
            return weights.get_slice(name)[rows[0] : rows[1]].to(torch.float32)


def _layer_shapes(config: dict[str, Any]) -> list[LayerShape]:
    layers = config["num_hidden_layers"]
    if is_pruned_model_type(config["model_type"]):
        return [
            LayerShape(tuple(kv_map), kv_count, width)
            for kv_map, kv_count, width in zip(
                config["layer_kv_of_query"],
                config["layer_num_kv_heads"],
                config["layer_intermediate_sizes"],
                strict=True,
            )
        ]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    kv_of_query = tuple(q // (heads // kv_heads) for q in range(heads))
    return [LayerShape(kv_of_query, kv_heads, config["intermediate_size"])] * layers


def _rope_theta(config: dict[str, Any]) -> float:
    """The RoPE base (the family's check_gguf has refused any scaling)."""
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:  # per layer type; the deci graph has one
        rope = rope["full_attention"]
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _sliding_window(config: dict[str, Any]) -> int | None:
    """The window when any layer slides, as the family's modeling reads it, else None."""
    model_config = config_from_dict(config)
    return family_of(model_config).layer_types(model_config)[0]


class _Writer:
    """Adds tensors in the requested float type, F32 for vectors."""

    def __init__(self, writer: gguf.GGUFWriter, float_type: str) -> None:
        self.writer = writer
        self.float_type = float_type

    def add(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor.contiguous().numpy()
        qtype = _FLOAT[self.float_type] if data.ndim > 1 else gguf.GGMLQuantizationType.F32
        self.writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _write_layer(
    out: _Writer,
    checkpoint: _Checkpoint,
    family: Family,
    index: int,
    shape: LayerShape,
    head_dim: int,
    hidden: int,
    scales: GgufScales,
) -> None:
    source, target = f"model.layers.{index}", f"blk.{index}"
    layout = attention_layout(shape)
    # A family that fuses projections (Phi-3) says where LLaMA's weights lie in its fused ones.
    fused = family.unfused_rows(len(shape.kv_of_query), shape.num_kv_heads, shape.ffn_width, head_dim)

    def read(name: str) -> torch.Tensor | None:
        if name in fused:
            fused_name, rows = fused[name]
            return checkpoint.tensor(f"{source}.{fused_name}", rows)
        full = f"{source}.{name}"
        return checkpoint.tensor(full) if checkpoint.has(full) else None

    if layout.query_order:
        out.add(f"{target}.attn_norm.weight", read("input_layernorm.weight"))
        for kind in ("weight", "bias"):
            q, k, v = (read(f"self_attn.{p}_proj.{kind}") for p in "qkv")
            if q is None:
                continue
            q = q * scales.query
            out.add(f"{target}.attn_q.{kind}", _rope_pairs(_heads(q, head_dim, layout.query_order), head_dim))
            out.add(f"{target}.attn_k.{kind}", _rope_pairs(_heads(k, head_dim, layout.kv_heads), head_dim))
            out.add(f"{target}.attn_v.{kind}", _heads(v, head_dim, layout.kv_heads))
        o = read("self_attn.o_proj.weight") * scales.sublayer_output
        columns = o.reshape(hidden, -1, head_dim)[:, list(layout.query_order)].reshape(hidden, -1)
        out.add(f"{target}.attn_output.weight", columns)
        if (o_bias := read("self_attn.o_proj.bias")) is not None:
            out.add(f"{target}.attn_output.bias", o_bias * scales.sublayer_output)
    else:
        if index == 0:  # a zero head: see the module docstring
            out.add(f"{target}.attn_norm.weight", read("input_layernorm.weight"))
            for name, rows, columns in (("q", head_dim, hidden), ("k", head_dim, hidden), ("v", head_dim, hidden)):
                out.add(f"{target}.attn_{name}.weight", torch.zeros(rows, columns))
            out.add(f"{target}.attn_output.weight", torch.zeros(hidden, head_dim))
        if checkpoint.has(f"{source}.self_attn.o_proj.bias"):
            raise UnsupportedExport(
                f"GGUF export: layer {index} has no heads but an o_proj bias, which llama.cpp drops"
            )
        # The norm feeds nothing without attention; the projections have no rows (or columns) left.
        checkpoint.unread.discard(f"{source}.input_layernorm.weight")
        checkpoint.unread -= {name for name in checkpoint.files if name.startswith(f"{source}.self_attn.")}

    out.add(f"{target}.ffn_norm.weight", read("post_attention_layernorm.weight"))
    mlp = {name: read(f"mlp.{name}.weight") for name in ("gate_proj", "up_proj", "down_proj")}
    biases = {name: read(f"mlp.{name}.bias") for name in ("gate_proj", "up_proj", "down_proj")}
    if shape.ffn_width == 0:  # one channel of zeros: see the module docstring
        mlp = {"gate_proj": torch.zeros(1, hidden), "up_proj": torch.zeros(1, hidden)}
        mlp["down_proj"] = torch.zeros(hidden, 1)
        biases.update({name: torch.zeros(1) for name in ("gate_proj", "up_proj") if biases[name] is not None})
    for name, gguf_name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
        scale = scales.sublayer_output if name == "down_proj" else 1.0
        out.add(f"{target}.{gguf_name}.weight", mlp[name] * scale)
        if biases[name] is not None:
            out.add(f"{target}.{gguf_name}.bias", biases[name] * scale)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _model_name(config: dict[str, Any], checkpoint_dir: Path) -> str:
    """general.name: a pruned checkpoint is named after its source model, since a job writes it in a staging
    directory (`.pruned.partial`) that is renamed afterwards (a sweep's dense pick, unpruned, too); a dense one
    after its directory."""
    casp = config.get("casp")
    if casp:
        ratio = casp["settings"]["ratio"]
        done = f"CASP-pruned, ratio {ratio}" if ratio is not None else "dense, the pick of a CASP sweep"
        return f"{casp['source_model']} ({done})"
    return checkpoint_dir.name


@dataclass(frozen=True)
class _Written:
    """What writing the float file decided, for GgufExport."""

    architecture: str
    kv_repeated_layers: tuple[int, ...]
    context_length: int
    tokenizer_caveat: str | None


def _write_float(checkpoint: _Checkpoint, out: Path, float_type: str) -> _Written:
    """The checkpoint as a GGUF of `float_type` weights at `out`."""
    config = checkpoint.config
    family = family_of(config["model_type"])
    shapes = _layer_shapes(config)
    layouts = [attention_layout(shape) for shape in shapes]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    head_counts = [len(layout.query_order) for layout in layouts]
    kv_counts = [len(layout.kv_heads) for layout in layouts]
    head_counts[0], kv_counts[0] = max(head_counts[0], 1), max(kv_counts[0], 1)
    ffn_widths = [max(shape.ffn_width, 1) for shape in shapes]
    uniform = len({(h, k, f) for h, k, f in zip(head_counts, kv_counts, ffn_widths, strict=True)}) == 1
    architecture = "llama" if uniform and head_counts[0] > 0 and shapes[0].ffn_width > 0 else "deci"
    window = _sliding_window(config)
    context_length = min(config["max_position_embeddings"], window or config["max_position_embeddings"])
    embedding = checkpoint.tensor("model.embed_tokens.weight")
    vocabulary = read_vocabulary(checkpoint.directory, embedding.shape[0])
    model_config = config_from_dict(config)
    scales = family.gguf_scales(model_config)

    writer = gguf.GGUFWriter(out, architecture)
    tensors = _Writer(writer, float_type)
    try:
        writer.add_name(_model_name(config, checkpoint.directory))
        writer.add_file_type(_FILE_TYPE[float_type])
        writer.add_block_count(len(shapes))
        writer.add_context_length(context_length)
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(ffn_widths[0] if architecture == "llama" else ffn_widths)
        writer.add_head_count(head_counts[0] if architecture == "llama" else head_counts)
        writer.add_head_count_kv(kv_counts[0] if architecture == "llama" else kv_counts)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(_rope_theta(config))
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_vocab_size(embedding.shape[0])
        write_vocabulary(writer, vocabulary)

        tensors.add("token_embd.weight", embedding * scales.embedding)
        for index, shape in enumerate(shapes):
            _write_layer(tensors, checkpoint, family, index, shape, head_dim, hidden, scales)
        tensors.add("output_norm.weight", checkpoint.tensor("model.norm.weight"))
        if not config.get("tie_word_embeddings", False):
            tensors.add("output.weight", checkpoint.tensor("lm_head.weight") * scales.logits)
        else:
            checkpoint.unread.discard("lm_head.weight")
            if (scales.embedding, scales.logits) != (1.0, 1.0):  # the head is no longer the embedding: its own
                tensors.add("output.weight", embedding * scales.logits)
        if checkpoint.unread:
            raise UnsupportedExport(
                f"GGUF export: no place in llama.cpp for {', '.join(sorted(checkpoint.unread)[:3])}"
            )

        kv_repeated = [index for index, layout in enumerate(layouts) if layout.repeated]
        writer.add_array("casp.kv_heads_repeated_layers", kv_repeated)
        if window is not None:
            writer.add_uint32("casp.sliding_window", window)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return _Written(architecture, tuple(kv_repeated), context_length, vocabulary.caveat)


@contextmanager
def _llama_cpp_log() -> Iterator[list[str]]:
    """llama.cpp's log, kept instead of printed while it quantizes (a line per tensor, and a warning per fallback,
    which the export names itself); llama-cpp-python's own logger is put back after."""
    import ctypes

    import llama_cpp

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def keep(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    previous, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(user_data))
    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(previous, user_data)


def _quantize(source: Path, out: Path, gguf_type: str) -> None:
    """llama.cpp's quantizer, with `llama-quantize`'s defaults: `gguf_type`'s mix of types per tensor."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}")
    with _llama_cpp_log() as log:
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        said = "".join(log).strip().splitlines()[-1:] or ["no message"]
        raise QuantizationFailed(f"llama.cpp could not quantize the GGUF to {gguf_type}: {said[0]}")


def fallbacks(tensors: list[Any], gguf_type: str) -> tuple[Fallback, ...]:
    """The weights of a `gguf_type` file (GGUFReader tensors, in the file's order) whose type is not the one
    llama.cpp's mix gives them (casp_core.artifacts.gguf.types.llama_cpp_types): its fallback for rows that are not
    whole blocks of that type."""
    if not is_quantized(gguf_type):
        return ()
    shapes = [
        Tensor(tensor.name, int(tensor.shape[1]) if len(tensor.shape) > 1 else 1, int(tensor.shape[0]))
        for tensor in tensors
    ]
    return tuple(
        Fallback(shape.name, tensor.tensor_type.name, choice.mix, shape.row_length, GGML_BLOCKS[choice.mix][1])
        for shape, tensor, choice in zip(shapes, tensors, llama_cpp_types(shapes, gguf_type), strict=True)
        if tensor.tensor_type.name != choice.mix and shape.row_length % GGML_BLOCKS[choice.mix][1]
    )


def export_gguf(checkpoint_dir: Path, out: Path, gguf_type: str = "f16") -> GgufExport:
    """Write `checkpoint_dir` (dense or pruned) as one GGUF file at `out`, replacing it only when complete."""
    if gguf_type not in GGUF_TYPES:
        raise InvalidConfig(f"gguf_type must be one of {', '.join(GGUF_TYPES)}, not {gguf_type!r}")
    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    checkpoint = _Checkpoint(checkpoint_dir)
    model_config = config_from_dict(checkpoint.config)
    check_export(model_config, ["gguf"])
    quantized = is_quantized(gguf_type)
    if quantized:
        require_llama_cpp()

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    source = out.with_name(f".{out.name}.f32.partial")  # what llama.cpp quantizes; never left beside `out`
    try:
        if quantized:
            written = _write_float(checkpoint, source, "f32")
            _quantize(source, partial, gguf_type)
        else:
            written = _write_float(checkpoint, partial, gguf_type)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
        source.unlink(missing_ok=True)
    tensors = gguf.GGUFReader(out).tensors
    weights = sum(int(tensor.n_elements) for tensor in tensors)
    return GgufExport(
        path=out,
        sha256=_sha256(out),
        architecture=written.architecture,
        gguf_type=gguf_type,
        tensor_types={tensor.name: tensor.tensor_type.name for tensor in tensors},
        fallbacks=fallbacks(tensors, gguf_type),
        bits_per_weight=sum(int(tensor.n_bytes) for tensor in tensors) * 8 / weights,
        bytes=out.stat().st_size,
        kv_repeated_layers=written.kv_repeated_layers,
        context_length=written.context_length,
        tokenizer_caveat=written.tokenizer_caveat,
    )


def gguf_file_name(gguf_type: str) -> str:
    return f"model-{gguf_type}.gguf"


def export_checkpoint(checkpoint_dir: Path, formats: list[str], gguf_type: str) -> list[GgufExport]:
    """The exports `casp prune --export` and a job's `export` ask for, written into the checkpoint directory."""
    exports = []
    if "gguf" in formats:
        exports.append(export_gguf(checkpoint_dir, checkpoint_dir / gguf_file_name(gguf_type), gguf_type))
    return exports
