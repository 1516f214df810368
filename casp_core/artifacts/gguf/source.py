"""A GGUF file as the model to prune: the file llama.cpp or Ollama serves, taken as the user has it.

Its header is checked before any work: a file that is not GGUF, one cut short, an architecture transformers'
GGUF loader or casp does not take, or a tensor type transformers cannot dequantize is refused, naming what is
wrong. Then transformers' own loader dequantizes it once into a model folder (safetensors, config, the tokenizer
and chat template the file carries), cached by the file's sha256 and the dtype: every later job on the same file
loads that folder like any other. The file's own types are quantized, so they are no dtype to keep: `dtype: auto`
is float32 on the CPU and bfloat16 on an accelerator.

The weights were dequantized from the file, so the pruned model carries the file's quantization error; the
report, the model card and a job's result say so, naming the file, its sha256 and its tensor types
(`GgufSource.summary`).
"""

import hashlib
import json
import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from casp_core.artifacts.caches import BoundedCache, cache_max_bytes
from casp_core.errors import InvalidModelFile, ModelNotFound, UnsupportedModel
from casp_core.families import family_of

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
# Written last into a converted folder: what the folder was made from. A folder without it was cut short.
SOURCE_RECORD = "casp_gguf_source.json"
CACHE_FOLDER = "gguf"  # under the cache directory casp_core is given (casp_core.artifacts.caches)
# The types whose weights are dequantized with no loss of their own (F32, F16 and BF16 are exact in float32).
FLOAT_TENSOR_TYPES = ("F32", "F16", "BF16")
# Sections of transformers' GGUF mapping that its list of architectures holds beside them.
NOT_ARCHITECTURES = {"general", "tokenizer"}
DEQUANTIZED = "the weights were dequantized from this file, so the pruned model carries the file's quantization error"


@dataclass(frozen=True)
class GgufSource:
    """The GGUF file a model came from."""

    file: str  # the file's name, never its local path
    sha256: str
    architecture: str  # the file's general.architecture
    model_type: str  # the transformers model type it loads as
    tensor_types: dict[str, int]  # ggml type -> how many tensors of the file have it

    @property
    def quantized(self) -> bool:
        return any(kind not in FLOAT_TENSOR_TYPES for kind in self.tensor_types)

    def summary(self) -> dict[str, Any]:
        """What the report, the model card and a job's result say of the source."""
        return {
            **asdict(self),
            "dequantized": True,
            "note": DEQUANTIZED if self.quantized else "the weights were read from this file's float tensors",
        }


def is_gguf_reference(name_or_path: str) -> bool:
    """A model named by a file ending in .gguf (any case) is a GGUF source."""
    return name_or_path.lower().endswith(GGUF_SUFFIX)


_PARSE_ONCE = threading.RLock()
_parsing_once = False  # set by the outermost scope, which holds _PARSE_ONCE


@contextmanager
def _each_file_parsed_once() -> Iterator[None]:
    """Within it, gguf-py parses each file once. transformers' GGUF loader makes a new `GGUFReader` for the config,
    for the weights and for the tokenizer, and each parses the whole header in Python (9 s for SmolLM2's 49K-token
    vocabulary on the 2-core VM, four times a conversion); it also builds a new tensor-name map for each of the
    model's modules (397 for SmolLM2: 14 s in all). The loader imports both from `gguf` when it runs, so they are
    replaced there for the scope's length, by a reader kept per file and a map kept per architecture and depth.
    Conversions in one process take turns, and a nested scope is the outer one."""
    global _parsing_once
    import gguf

    with _PARSE_ONCE:
        if _parsing_once:  # this thread's outer scope has replaced them already, and puts them back
            yield
            return
        new_reader, new_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], Any] = {}

        def kept_reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
            key = (str(Path(path).resolve()), mode)
            if key not in readers:
                readers[key] = new_reader(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = kept_reader, lru_cache(maxsize=None)(new_name_map)
        _parsing_once = True
        try:
            yield
        finally:
            _parsing_once = False
            gguf.GGUFReader, gguf.get_tensor_name_map = new_reader, new_name_map


def _dequantizable_types() -> set[str]:
    """The ggml types the `gguf` package (which transformers' loader calls) dequantizes."""
    from gguf.quants import _type_traits  # the registry `gguf.quants.dequantize` dispatches on

    implemented = {qtype.name for qtype, traits in _type_traits.items() if "dequantize_blocks" in vars(traits)}
    return {"F32", "F16"} | implemented


def check_gguf_file(path: Path) -> GgufSource:
    """Read and check the header of the GGUF file at `path` (no weight is dequantized). Raises ModelNotFound for no
    such file, InvalidModelFile for a file that is not GGUF or is cut short, UnsupportedModel for an architecture
    or a tensor type that transformers' loader or casp does not take."""
    if not path.is_file():
        raise ModelNotFound(f"model file {path.name!r} does not exist or is not a file")
    stat = path.stat()
    # Named as the caller names it: a link (a Hugging Face cache's) is the file people know, its target a digest.
    return replace(_read_header(path.resolve(), stat.st_size, stat.st_mtime_ns)[0], file=path.name)


def gguf_config(path: Path) -> PretrainedConfig:
    """The transformers config the GGUF file at `path` loads as, from its header (checked as `check_gguf_file`)."""
    from transformers import CONFIG_MAPPING

    check_gguf_file(path)
    stat = path.stat()
    settings = dict(_read_header(path.resolve(), stat.st_size, stat.st_mtime_ns)[1])
    return CONFIG_MAPPING[settings["model_type"]].from_dict(settings)


@lru_cache(maxsize=16)
def _read_header(path: Path, size: int, mtime_ns: int) -> tuple[GgufSource, dict[str, Any]]:
    """The file's source record and the config transformers reads from it, once per process for each (path, size,
    modification time): reading a header parses the whole vocabulary (seconds for a large one)."""
    with path.open("rb") as file:
        magic = file.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise InvalidModelFile(f"{path.name} is not a GGUF file: it does not start with the GGUF magic bytes")
    with _each_file_parsed_once():
        return _checked_header(path, size, mtime_ns)


def _checked_header(path: Path, size: int, mtime_ns: int) -> tuple[GgufSource, dict[str, Any]]:
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    try:
        reader = GGUFReader(path)
    # The header, or a tensor's data, runs past the end of the file: numpy cannot shape what is not there.
    except (ValueError, IndexError, OSError) as error:
        raise InvalidModelFile(f"{path.name} is a damaged or truncated GGUF file ({error})") from error
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    tensor_types = dict(Counter(tensor.tensor_type.name for tensor in reader.tensors))
    unknown = sorted(set(tensor_types) - _dequantizable_types())
    if unknown:
        raise UnsupportedModel(
            f"{path.name}: transformers cannot dequantize its tensor type(s) {', '.join(unknown)} "
            f"(it reads {', '.join(sorted(_dequantizable_types()))})"
        )
    try:
        settings = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    except ValueError as error:
        raise UnsupportedModel(
            f"{path.name}: transformers' GGUF loader does not read the architecture {architecture!r} "
            f"(it reads {', '.join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - NOT_ARCHITECTURES))})"
        ) from error
    try:
        family_of(settings["model_type"])
    except UnsupportedModel as error:  # a family casp does not prune: the message names those it does
        raise UnsupportedModel(f"{path.name}: {error}") from error
    source = GgufSource(path.name, _sha256(path, size, mtime_ns), architecture, settings["model_type"], tensor_types)
    return source, settings


def file_sha256(path: Path) -> str:
    """The file's sha256, computed once per process for each (path, size, modification time)."""
    stat = path.stat()
    return _sha256(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=64)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype a GGUF source is loaded in: `auto` is float32 on the CPU and bfloat16 on an accelerator."""
    if dtype != "auto":
        return getattr(torch, dtype)
    return torch.float32 if device.type == "cpu" else torch.bfloat16


@contextmanager
def converted_folder(path: Path, dtype: torch.dtype, cache_dir: Path) -> Iterator[Path]:
    """The folder the GGUF file at `path` was dequantized into, in `dtype`, made now unless the cache holds it, and
    held in the cache (`BoundedCache`, `$CASP_CACHE_MAX_BYTES`) while the block runs: load it there. Once loaded, an
    eviction cannot hurt the model (its files stay readable until they are closed), and a later load makes it anew."""
    if not path.is_file():
        raise ModelNotFound(f"model file {path.name!r} does not exist or is not a file")
    cache = BoundedCache(cache_dir / CACHE_FOLDER, cache_max_bytes())
    entry = _folder(path, str(dtype).removeprefix("torch."), cache_dir).name
    if not (cache.root / entry / SOURCE_RECORD).is_file():  # else made from this very file, checked then
        with _each_file_parsed_once():
            source = check_gguf_file(path)  # a file that is no model to prune leaves nothing in the cache
            with cache.exclusive():
                cache.remove_abandoned_partials()
            with cache.partial() as partial:
                _dequantize_into(path, dtype, partial)
                record = {**asdict(source), "converted_at": datetime.now(UTC).isoformat(timespec="seconds")}
                (partial / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
                cache.add(partial, entry)
    evicted = f"{path.name}: its dequantized folder was evicted from the cache before it loaded"
    with cache.held(entry, evicted) as folder:
        yield folder


def _folder(path: Path, dtype: str, cache_dir: Path) -> Path:
    return cache_dir / CACHE_FOLDER / f"{file_sha256(path)}-{dtype}"


def gguf_source_for(name_or_path: str, dtype: str, cache_dir: Path) -> GgufSource | None:
    """The GGUF file a job's model names, as recorded when it was dequantized in `dtype` (read again from the
    file's header if the cache lost the folder); None for a model that is no GGUF file."""
    if not is_gguf_reference(name_or_path):
        return None
    path = Path(name_or_path).expanduser()
    recorded = source_of(_folder(path, dtype, cache_dir))
    return replace(recorded, file=path.name) if recorded else check_gguf_file(path)


def _dequantize_into(path: Path, dtype: torch.dtype, folder: Path) -> None:
    """transformers' GGUF loader dequantizes the file; the model it returns calls itself quantized and refuses
    `save_pretrained`, so its weights, config and tokenizer are written one by one, without the quantization
    record that would make transformers look for the GGUF file again."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = model.config
    del config.quantization_config
    config._name_or_path = ""  # the file's general.name, not a path or a hub id
    config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))  # the tied head once, as transformers writes it
    tokenizer.save_pretrained(folder)


def source_of(folder: Path) -> GgufSource | None:
    """The GGUF file a converted folder was made from; None for any other model folder."""
    record = folder / SOURCE_RECORD
    if not record.is_file():
        return None
    fields = json.loads(record.read_text())
    return GgufSource(**{name: fields[name] for name in GgufSource.__dataclass_fields__})
