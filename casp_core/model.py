"""Model adapter: loads a causal LM of a supported family and names the parts CASP prunes.

A decoder layer has attention (q/k/v/o_proj; units are query heads, blocks of `head_dim` input columns of
o_proj) and a gated MLP (gate/up/down_proj; units are intermediate channels, input columns of down_proj).
What each family's units are and what it accepts is its module's (casp_core.families). Anything else is refused
with `unsupported_model` before any work, from the config alone. The digests that name what casp keeps between
runs (a cache entry's key, a model's weights) are here too, below every room that keeps something.
"""

import ctypes
import hashlib
import json
import mmap
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, StrictDataclassError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from casp_core.artifacts.caches import default_cache_dir
from casp_core.artifacts.gguf.source import converted_folder, gguf_config, gguf_dtype, is_gguf_reference
from casp_core.errors import DeviceUnavailable, InvalidConfig, ModelNotFound, UnsupportedModel
from casp_core.families import family_of, projection_parameters, projections
from casp_core.units import AttentionGeometry

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """`auto` is cuda when available, else cpu. A device this machine lacks is refused here, before any work,
    rather than by an assertion deep inside torch at the first tensor moved to it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except RuntimeError as error:
        raise InvalidConfig(f"device: {device!r} is not a device name (auto, cpu, cuda, cuda:1, ...)") from error
    if target.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise DeviceUnavailable(f"device {device!r}: this torch build has no CUDA support; use cpu or auto")
        count = torch.cuda.device_count()
        if count == 0:
            raise DeviceUnavailable(f"device {device!r}: no CUDA GPU is visible on this machine; use cpu or auto")
        if target.index is not None and target.index >= count:
            raise DeviceUnavailable(
                f"device {device!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
            )
    return target


def is_local_reference(name_or_path: str) -> bool:
    """Anything that starts like a path, or names a GGUF file other than by a URL, is one; everything else is a
    Hugging Face id."""
    return name_or_path.startswith((".", "/", "~")) or (is_gguf_reference(name_or_path) and "://" not in name_or_path)


def check_model_reference(name_or_path: str) -> None:
    """A Hugging Face id is `org/name`; a `.gguf` must be a local file, anything else that starts like a path a
    local directory."""
    if is_gguf_reference(name_or_path):
        if not Path(name_or_path).expanduser().is_file():
            raise ModelNotFound(f"model file {name_or_path!r} does not exist or is not a file")
        return
    if is_local_reference(name_or_path):
        if not Path(name_or_path).expanduser().is_dir():
            raise ModelNotFound(f"model path {name_or_path!r} does not exist or is not a directory")
        return
    try:
        validate_repo_id(name_or_path)
    except HFValidationError as error:
        raise ModelNotFound(f"{name_or_path!r} is neither a local path nor a Hugging Face id: {error}") from error


# What transformers reads from a hub repository: weights as safetensors where the repository has them, the
# PyTorch pickles only where it has none; never the original/consolidated copies some repositories add.
HUB_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.safetensors"]
HUB_SKIPPED = ["original/*", "consolidated*"]


def model_source(name_or_path: str, revision: str | None = None, token: str | None = None) -> Path:
    """The local folder to load from. A hub id is resolved through the Hugging Face cache (downloading into it
    unless HF_HUB_OFFLINE is set, with `token` for a private repository), so transformers gets an absolute folder
    and never reads a same-named relative path from the working directory."""
    check_model_reference(name_or_path)
    if is_local_reference(name_or_path):
        return Path(name_or_path).expanduser()
    try:
        folder = Path(
            snapshot_download(
                name_or_path, revision=revision, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIPPED, token=token
            )
        )
        if not any(folder.glob("*.safetensors")):
            folder = Path(
                snapshot_download(
                    name_or_path,
                    revision=revision,
                    allow_patterns=[*HUB_FILES, "*.bin"],
                    ignore_patterns=HUB_SKIPPED,
                    token=token,
                )
            )
    except (OSError, ValueError) as error:  # not cached offline, unknown repository or revision, no network
        # `org/name` is a hub id even where a folder of that name is at hand; say how to mean the folder instead.
        hint = f" (for the folder {name_or_path} here, write ./{name_or_path})" if Path(name_or_path).is_dir() else ""
        raise ModelNotFound(
            f"cannot get model {name_or_path!r} from the Hugging Face hub or its cache{hint}: {error}"
        ) from error
    return folder


def _first_line(error: Exception) -> str:
    """transformers explains load errors over several lines; a CLI error and a job's message take one."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def load_config(name_or_path: str, *, revision: str | None = None, token: str | None = None) -> PretrainedConfig:
    """The model's config, checked by `check_supported_config`; a reference that names no model
    (`check_model_reference`) or a config that cannot be read is `model_not_found`. A GGUF file's comes from its
    header, which is checked first (casp_core.artifacts.gguf.source). `token`: for a private repository."""
    check_model_reference(name_or_path)
    if is_gguf_reference(name_or_path):
        config = gguf_config(Path(name_or_path).expanduser())
        check_supported_config(config)
        return config
    try:
        settings, _ = PretrainedConfig.get_config_dict(name_or_path, revision=revision, token=token)
    except OSError as error:
        raise ModelNotFound(f"cannot read the config of model {name_or_path!r}: {_first_line(error)}") from error
    if not settings:  # what transformers returns for a local folder without config.json
        raise ModelNotFound(f"cannot read the config of model {name_or_path!r}: the folder has no config.json")
    # Checked before transformers builds the config: it cannot build one of a type it does not know.
    family_of(settings.get("model_type"))
    try:
        config = AutoConfig.from_pretrained(name_or_path, revision=revision, token=token)
    # StrictDataclassError: a setting of the wrong type for the config class (transformers 5.4's Olmo2Config
    # refuses the `tie_word_embeddings: false` of every OLMo 2 config.json).
    except (OSError, ValueError, TypeError, StrictDataclassError) as error:
        raise UnsupportedModel(f"the config of model {name_or_path!r} is not valid: {_first_line(error)}") from error
    check_supported_config(config)
    return config


def load_model(
    name_or_path: str,
    *,
    revision: str | None = None,
    dtype: str = "auto",
    token: str | None = None,
    device: torch.device | None = None,
    cache_dir: Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load weights on the CPU; the pipeline moves one decoder layer at a time to the accelerator (`device`, the
    CPU when None). `token`: a Hugging Face token for a private repository, handed to the hub's calls only (never
    kept or written). A GGUF file is loaded from the folder it was dequantized into (casp_core.artifacts.gguf.source),
    made in `cache_dir` (default: casp_core.artifacts.caches) the first time."""
    if is_gguf_reference(name_or_path):
        check_model_reference(name_or_path)
        torch_dtype = gguf_dtype(dtype, device or torch.device("cpu"))
        gguf_file = Path(name_or_path).expanduser()
        with converted_folder(gguf_file, torch_dtype, cache_dir or default_cache_dir()) as folder:
            return _load_folder(str(folder), name_or_path, torch_dtype, token)
    # A hub id: its folder in the cache, never the cwd.
    source = str(model_source(name_or_path, revision, token))
    return _load_folder(source, name_or_path, "auto" if dtype == "auto" else DTYPES[dtype], token)


def _load_folder(
    source: str, name_or_path: str, torch_dtype: str | torch.dtype, token: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    config = load_config(source)
    tokenizer = load_tokenizer(source)  # cheap, so a missing one fails first
    try:
        model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=torch_dtype, token=token)
    except OSError as error:
        raise ModelNotFound(f"cannot load the weights of model {name_or_path!r}: {_first_line(error)}") from error
    model.eval()
    check_supported(model)
    family_of(config).prepare(model)
    return model, tokenizer


def load_tokenizer(name_or_path: str, *, revision: str | None = None) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision)
    except (OSError, ValueError, TypeError) as error:
        raise ModelNotFound(f"cannot load the tokenizer of model {name_or_path!r}: {_first_line(error)}") from error
    folder = Path(name_or_path).expanduser()
    vocabulary_files = sorted(set(tokenizer.vocab_files_names.values()))
    # Without its files transformers builds an empty tokenizer for some families (Qwen2) instead of failing.
    if folder.is_dir() and not any((folder / name).is_file() for name in vocabulary_files):
        raise ModelNotFound(
            f"cannot load the tokenizer of model {name_or_path!r}: the folder has none of {', '.join(vocabulary_files)}"
        )
    return tokenizer


# A weight mismatch names at most this many tensors.
MISMATCHES_NAMED = 3


def check_model_folder(folder: Path) -> PretrainedConfig:
    """A model folder fit to prune, from its files' headers alone: a config of a supported family
    (`load_config`), a tokenizer, and safetensors weights that are exactly the tensors that config's model has, in
    its shapes (no weight is read). Raises ModelNotFound or UnsupportedModel saying what is wrong."""
    config = load_config(str(folder))
    load_tokenizer(str(folder))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        advice = ""
        if any(folder.glob("*.bin")):
            advice = " (PyTorch *.bin pickles are not read: convert them to safetensors)"
        raise ModelNotFound(f"the folder has no *.safetensors weights{advice}")
    with torch.device("meta"):  # the model's tensors with their shapes, and no memory
        expected = {name: tuple(t.shape) for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    found: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as weights:  # reads the header only
                found |= {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118
        except SafetensorError as error:
            raise ModelNotFound(f"{file.name} is not readable safetensors: {error}") from error
    if config.tie_word_embeddings:  # the head is the embedding: files hold it once
        expected.pop("lm_head.weight", None)
        found.pop("lm_head.weight", None)
    problems = [f"{name} is missing" for name in sorted(expected.keys() - found.keys())]
    problems += [f"{name} is not a weight of {config.model_type}" for name in sorted(found.keys() - expected.keys())]
    problems += [
        f"{name} has shape {list(found[name])}, config.json makes it {list(shape)}"
        for name, shape in sorted(expected.items())
        if name in found and found[name] != shape
    ]
    if problems:
        more = f" (and {len(problems) - MISMATCHES_NAMED} more)" if len(problems) > MISMATCHES_NAMED else ""
        raise UnsupportedModel(f"the weights do not match config.json: {'; '.join(problems[:MISMATCHES_NAMED])}{more}")
    return config


def check_supported_config(model_config: PretrainedConfig) -> None:
    """Refuse, from the config alone, any model whose settings the pruned model class cannot carry."""
    family_of(model_config).check_config(model_config)


def attention_layer_types(model_config: PretrainedConfig) -> tuple[int | None, list[str]]:
    """The sliding window and, per layer, whether attention is full or within that window, as the family's
    own modeling reads them (casp_core.families: Family.layer_types)."""
    return family_of(model_config).layer_types(model_config)


def check_supported(model: nn.Module) -> None:
    """Decoder layers at model.model.layers, each with the projections its family names."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) == 0:
        raise UnsupportedModel(
            f"{type(model).__name__} is not supported: expected decoder layers at model.model.layers"
        )
    family = family_of(model.config)
    layer = layers[0]
    missing = [path for path in family.projection_paths.values() if not isinstance(_submodule(layer, path), nn.Linear)]
    if missing:
        raise UnsupportedModel(
            f"{type(model).__name__} is not supported: its decoder layers have no {', '.join(missing)} "
            f"(CASP needs the {family.name} layout)"
        )


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


@contextmanager
def on_device(module: nn.Module, device: torch.device, home: torch.device) -> Iterator[None]:
    """`module` on `device` while it works, then back at `home`, where its weights rest between uses (the device
    itself when the model is resident there, the CPU when it is offloaded: casp_core.method.placement)."""
    module.to(device)
    try:
        yield
    finally:
        module.to(home)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def attention_geometry(model: PreTrainedModel, layer: nn.Module) -> AttentionGeometry:
    """Read from the layer itself when it is already pruned, else from the model's config."""
    attention = layer.self_attn
    parts = projections(layer)
    kv_of_query = getattr(attention, "kv_of_query", None)
    head_dim = attention.head_dim
    if kv_of_query is not None:
        return AttentionGeometry(head_dim, tuple(kv_of_query), parts.k.out_features // head_dim)
    num_heads = parts.q.out_features // head_dim
    num_kv_heads = parts.k.out_features // head_dim
    group = num_heads // num_kv_heads
    return AttentionGeometry(head_dim, tuple(q // group for q in range(num_heads)), num_kv_heads)


def sublayer_parameters(layer: nn.Module) -> tuple[int, int]:
    """Parameters of (attention, MLP) projections: what the pruning ratio is measured against."""
    parts = projections(layer)
    return (
        sum(projection_parameters(p) for p in parts.attention),
        sum(projection_parameters(p) for p in parts.mlp),
    )


def prunable_parameters(model: nn.Module) -> int:
    return sum(sum(sublayer_parameters(layer)) for layer in decoder_layers(model))


def key_digest(key: Any) -> str:
    """The sha256 of `key` as JSON with sorted keys: equal for equal keys whatever order their dicts were built in."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


DIGEST_SLICE = 1 << 24  # elements: 128 MiB in float64


@torch.no_grad()
def weights_digest(model: nn.Module) -> str:
    """A digest of the weights (names, shapes, float64 sums): what a retry that prunes again must find the same
    (recovery's saved state, the zero-shot scores kept). Summed a slice at a time: Llama-3-8B's embedding in
    float64 at once would be 4 GiB more."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        total = sum(float(part.double().sum()) for part in tensor.reshape(-1).split(DIGEST_SLICE))
        digest.update(f"{name}{tuple(tensor.shape)}{total:.17g}".encode())
    return digest.hexdigest()


_MADV_DONTNEED = 4  # Linux: the pages leave the process; a file mapping reads them again from the file if touched


def release_weights(module: nn.Module) -> None:
    """Free `module`'s parameters now, leaving them on the meta device.

    Weights loaded from safetensors are views of a memory-mapped file that stays mapped while any of its tensors
    lives (the embeddings, shared with the pruned model): dropping a tensor alone leaves its pages resident,
    and the masked or compensated ones are private copies. The whole pages inside each tensor are handed back
    to the kernel first, so resident memory falls as each layer is released."""
    if sys.platform == "linux":
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        for tensor in module.parameters():
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                continue
            start = -(-tensor.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
            end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > start:
                madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
    module.to_empty(device="meta")


def return_freed_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing happens): memory
    freed in many small blocks otherwise stays resident in the process."""
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None
    if malloc_trim is not None:
        malloc_trim(0)
