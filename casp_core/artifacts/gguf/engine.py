"""Quality and speed in the engine that serves the file: each exported GGUF measured in llama.cpp itself.

Perplexity follows the transformers evaluation exactly (casp_core.eval.perplexity, docs/evaluation.md): the same
windows of the same token ids (the transformers tokenizer's, BOS once at the start of the stream, so llama.cpp's
own tokenizer plays no part), each window scored on its own from an empty KV cache, exp(mean next-token NLL)
over `n_windows x (seq_len - 1)` tokens. llama.cpp runs with its default KV cache (f16) on as many threads as torch
uses (`perplexity_threads`): each row of a product is one thread's work whatever their number, so the figure is the
same at any count (tests/core/artifacts/gguf/test_engine.py), only sooner. The NLL is taken from its float32 logits as
the transformers evaluation takes it. A window goes through llama.cpp a chunk of
`tokens_per_chunk` positions at a time (64 MiB of logits, as casp_core.method.next_token's), each chunk's logits read
from llama.cpp's own buffer: one pass over a 2048-token window with every position's logits held them three times
over (llama.cpp's graph, its output buffer, llama-cpp-python's copy; 0.4 GB each at SmolLM2's 49K vocabulary,
1 GB at 128K), beside the pruned model a job still holds.

Speed is llama.cpp's at one thread: a prefill of `PREFILL_TOKENS` tokens, then `DECODE_TOKENS` tokens decoded
one at a time after it, each the median of `SPEED_REPEATS` runs after one untimed run.

`artifact_table` lays out one row per file the job wrote (the safetensors checkpoint, measured by transformers,
and each GGUF, measured here): the table of report.json's `artifacts`, the model card and the job's result.
llama-cpp-python is optional: without it the GGUF rows carry their bytes and bits per weight, no figures, and
the table says why.
"""

import json
import math
import statistics
import struct
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import gguf
import numpy as np
import torch

from casp_core.artifacts.gguf.types import LLAMA_CPP_MISSING, llama_cpp_module
from casp_core.artifacts.gguf.writer import GgufExport
from casp_core.eval.perplexity import EvaluationText
from casp_core.method.next_token import tokens_per_chunk
from casp_core.run import Run

if TYPE_CHECKING:
    import llama_cpp

SPEED_THREADS = 1
PREFILL_TOKENS = 128
DECODE_TOKENS = 64
SPEED_REPEATS = 3
SPEED_SEED = 0
ENGINE_MISSING = f"llama.cpp figures not measured: {LLAMA_CPP_MISSING}"


@dataclass(frozen=True)
class EngineFigures:
    """One GGUF file measured in llama.cpp."""

    perplexity: dict[str, float]  # by text name: the transformers evaluation's windows and convention
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True)
class ArtifactRow:
    """One file of the job's output as it would be deployed."""

    file: str
    format: Literal["safetensors", "gguf"]
    type: str  # the tensors' dtype (f32, bf16, ...) or the GGUF type asked for (f16, q8_0, ...)
    bytes: int  # the file(s) on disk
    bits_per_weight: float  # 8 x tensor data bytes / weights, llama.cpp's BPW (metadata and vocabulary left out)
    perplexity: dict[str, float | None]  # by text name
    perplexity_in: Literal["transformers", "llama.cpp"] | None  # None: not measured (see the table's note)
    prefill_tokens_per_s: float | None = None  # llama.cpp at SPEED_THREADS; GGUF rows only
    decode_tokens_per_s: float | None = None


def engine_convention() -> dict[str, Any]:
    """How the GGUF rows were measured, for the report."""
    return {
        "engine": "llama.cpp",
        "llama_cpp_python": metadata.version("llama-cpp-python"),
        "threads": SPEED_THREADS,
        "perplexity_threads": perplexity_threads(),
        "kv_cache": "llama.cpp's default (f16)",
        "prefill_tokens": PREFILL_TOKENS,
        "decode_tokens": DECODE_TOKENS,
        "speed": f"median of {SPEED_REPEATS} runs after 1 untimed run",
    }


def perplexity_threads() -> int:
    """The threads llama.cpp's perplexity runs on: torch's, so both engines take the machine alike."""
    return torch.get_num_threads()


def _load(path: Path, n_ctx: int, n_batch: int, threads: int) -> "llama_cpp.Llama":
    llama_cpp = llama_cpp_module()
    assert llama_cpp is not None, "callers check llama_cpp_module() first"
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_batch,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def vocabulary_size(path: Path) -> int:
    """The number of tokens in the GGUF file's vocabulary, from its header."""
    return len(gguf.GGUFReader(path).fields[gguf.Keys.Tokenizer.LIST].data)


def window_nll(llm: "llama_cpp.Llama", window: list[int]) -> float:
    """Summed next-token NLL of one window, from an empty KV cache, `llm.n_batch` positions at a time: each chunk
    decoded with every position's logits, scored from llama.cpp's buffer (a view, no copy) as the transformers
    evaluation scores its float32 logits."""
    llama_cpp = llama_cpp_module()
    assert llama_cpp is not None, "callers check llama_cpp_module() first"
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), -1, 0, -1)
    batch = llama_cpp.llama_batch_init(llm.n_batch, 0, 1)
    total = 0.0
    try:
        for start in range(0, len(window) - 1, llm.n_batch):
            chunk = window[start : start + llm.n_batch]
            batch.n_tokens = len(chunk)
            for index, token in enumerate(chunk):
                batch.token[index] = token
                batch.pos[index] = start + index
                batch.n_seq_id[index] = 1
                batch.seq_id[index][0] = 0
                batch.logits[index] = True
            if llama_cpp.llama_decode(llm.ctx, batch) != 0:
                raise RuntimeError(f"llama_decode failed at position {start}")
            targets = torch.tensor(window[start + 1 : start + len(chunk) + 1])
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(len(chunk), llm.n_vocab()))
            scored = torch.from_numpy(logits[: len(targets)])
            total += float(torch.nn.functional.cross_entropy(scored, targets, reduction="sum"))
    finally:
        llama_cpp.llama_batch_free(batch)
    return total


def engine_perplexity(llm: "llama_cpp.Llama", text: EvaluationText, run: Run | None = None) -> float:
    run = run or Run()
    windows = text.windows.tolist()
    total_nll = 0.0
    for index, window in enumerate(windows):
        run.check_cancelled()
        total_nll += window_nll(llm, window)
        run.report("evaluation", (index + 1) / len(windows), f"llama.cpp perplexity {text.dataset}")
    return math.exp(total_nll / text.windows[:, 1:].numel())


def engine_speed(path: Path, repeats: int = SPEED_REPEATS, threads: int = SPEED_THREADS) -> tuple[float, float]:
    """(prefill, decode) tokens per second at `threads` (the job's figures: one), the median of `repeats` timed
    runs; see the module docstring."""
    llm = _load(path, PREFILL_TOKENS + DECODE_TOKENS, PREFILL_TOKENS + DECODE_TOKENS, threads)
    try:
        ids = np.random.default_rng(SPEED_SEED).integers(0, llm.n_vocab(), PREFILL_TOKENS + DECODE_TOKENS).tolist()
        prompt, continuation = ids[:PREFILL_TOKENS], ids[PREFILL_TOKENS:]
        prefill_runs, decode_runs = [], []
        for repeat in range(repeats + 1):
            llm.reset()
            start = time.perf_counter()
            llm.eval(prompt)
            prefilled = time.perf_counter()
            for token in continuation:
                llm.eval([token])
            if repeat:  # the first run maps the weights in and warms the caches
                prefill_runs.append(prefilled - start)
                decode_runs.append(time.perf_counter() - prefilled)
    finally:
        llm.close()
    return PREFILL_TOKENS / statistics.median(prefill_runs), DECODE_TOKENS / statistics.median(decode_runs)


def gguf_perplexity(path: Path, texts: dict[str, EvaluationText], run: Run | None = None) -> dict[str, float]:
    """Perplexity on each text (the same windows as transformers'), in llama.cpp at `perplexity_threads`."""
    run = run or Run()
    perplexity = {}
    if texts:
        n_ctx = max(text.windows.shape[1] for text in texts.values())
        llm = _load(path, n_ctx, min(n_ctx, tokens_per_chunk(vocabulary_size(path))), perplexity_threads())
        try:
            for name, text in texts.items():
                perplexity[name] = engine_perplexity(llm, text, run)
        finally:
            llm.close()
    return perplexity


def measure_gguf(path: Path, texts: dict[str, EvaluationText], run: Run | None = None) -> EngineFigures:
    """Perplexity on each text (the same windows as transformers') and speed at one thread, in llama.cpp."""
    run = run or Run()
    perplexity = gguf_perplexity(path, texts, run)
    run.check_cancelled()
    run.report("evaluation", 0.0, f"llama.cpp speed of {path.name}")
    prefill, decode = engine_speed(path)
    return EngineFigures(perplexity, prefill, decode)


def gguf_bits_per_weight(path: Path) -> float:
    tensors = gguf.GGUFReader(path).tensors
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (its format: an 8-byte little-endian length, then the JSON)."""
    with path.open("rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        header: dict[str, Any] = json.loads(stream.read(length))
    header.pop("__metadata__", None)
    return header


def safetensors_row(directory: Path, perplexity: dict[str, float]) -> ArtifactRow:
    """The checkpoint's row: its weight files (one, or the shards together), measured by transformers."""
    files = sorted(directory.glob("*.safetensors"))
    entries = [entry for file in files for entry in _safetensors_header(file).values()]
    data_bytes = sum(entry["data_offsets"][1] - entry["data_offsets"][0] for entry in entries)
    weights = sum(math.prod(entry["shape"]) for entry in entries)
    return ArtifactRow(
        file=files[0].name if len(files) == 1 else f"{len(files)} safetensors shards",
        format="safetensors",
        type="/".join(sorted({entry["dtype"].lower() for entry in entries})),
        bytes=sum(file.stat().st_size for file in files),
        bits_per_weight=8 * data_bytes / weights,
        perplexity=dict(perplexity),
        perplexity_in="transformers",
    )


def measure_exports(
    exports: list[GgufExport], texts: dict[str, EvaluationText], run: Run | None = None
) -> list[EngineFigures | None]:
    """Each exported GGUF measured in llama.cpp; without llama-cpp-python, a None for each and a warning."""
    run = run or Run()
    if exports and llama_cpp_module() is None:
        run.warn(ENGINE_MISSING)
        return [None] * len(exports)
    return [measure_gguf(export.path, texts, run) for export in exports]


def artifact_table(
    directory: Path,
    published_perplexity: dict[str, float],
    exports: list[GgufExport],
    figures: list[EngineFigures | None],
    text_names: list[str],
) -> dict[str, Any]:
    """report.json's `artifacts`: {"rows": [ArtifactRow as a dict], "engine": engine_convention() or None, "note"}.

    `directory` holds the checkpoint, `published_perplexity` is the transformers figure of the model saved there
    (by text name), `exports` the GGUF files written beside it and `figures` what `measure_exports` found."""
    rows = [safetensors_row(directory, published_perplexity)]
    for export, measured in zip(exports, figures, strict=True):
        rows.append(
            ArtifactRow(
                file=export.path.name,
                format="gguf",
                type=export.gguf_type,
                bytes=export.path.stat().st_size,
                bits_per_weight=gguf_bits_per_weight(export.path),
                perplexity=dict(measured.perplexity) if measured else dict.fromkeys(text_names),
                perplexity_in="llama.cpp" if measured else None,
                prefill_tokens_per_s=measured.prefill_tokens_per_s if measured else None,
                decode_tokens_per_s=measured.decode_tokens_per_s if measured else None,
            )
        )
    engine_measured = any(measured is not None for measured in figures)
    note = ENGINE_MISSING if exports and not engine_measured else None
    return {
        "rows": [asdict(row) for row in rows],
        "engine": engine_convention() if engine_measured else None,
        "note": note,
    }
