"""The dense model's evaluation, measured once per model: a later job on the same model, texts and evaluation
settings reuses the figures of the first instead of measuring them again (on SmolLM2-135M, 413 of a job's
1,093 seconds went to the dense evaluation).

An entry is a JSON file in `<cache_dir>/dense-evaluation/`, named by the sha256 of its key (`evaluation_key`):

- the source: a hub model's resolved commit, a GGUF source's file sha256 (casp_core.artifacts.gguf.source), else the
sha256   of the local folder's weight, config and code files;
- the dtype, and the kind of device the figures were measured on;
- each text's convention (data set, split, seq_len, windows, BOS) and the sha256 of its windows' token ids, which
  change with the data file, the tokenizer, seq_len and the limit;
- the zero-shot tasks, their limit, batch size and data folder;
- `EVALUATION_VERSION` and the versions of torch, transformers and (with zero-shot tasks) lm_eval.

Only perplexity and zero-shot accuracy are kept. Efficiency is measured again in every job, beside the pruned
model's: latency from another run, on a machine then busy with other work, is no comparison.

Entries are written to a temporary file renamed into place, so jobs running at once read a whole entry or none;
an entry that cannot be read, or holds another key, is ignored and written over.
"""

import hashlib
import json
import os
import tempfile
import time
from contextlib import suppress
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.artifacts.gguf.source import file_sha256, source_of
from casp_core.eval.evaluate import EVALUATION_VERSION, EvaluationPlan, Figures, evaluate
from casp_core.model import key_digest, resolve_device
from casp_core.report.build import library_versions
from casp_core.run import Run

CACHE_FOLDER = "dense-evaluation"  # under the cache directory casp_core is given (casp_core.artifacts.caches)
# Each file's sha256 by (path, size, modification time), so a local folder's weights are read once, not per job.
FILE_DIGESTS = "file-digests"
# A local folder's files that decide the model's outputs: weights, configs, and the modeling code of a checkpoint.
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json", ".py")
KEPT_FIGURES = ("perplexity", "zero_shot")
DENSE_STAGE = "evaluation_dense"  # the timer's name for the dense model's evaluation


def evaluate_dense(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, plan: EvaluationPlan, run: Run, cache_dir: Path
) -> Figures:
    """The dense model's figures: those kept in `cache_dir` under the same key (`reused_from` says when they
    were measured, and an event says they were reused), else measured now, timed as `DENSE_STAGE`, and kept."""
    folder = cache_dir / CACHE_FOLDER
    key = evaluation_key(model, plan, folder)
    entry = folder / f"{key_digest(key)}.json"
    kept = read_entry(entry, key)
    if kept is not None:
        measured_at = kept["measured_at"]
        run.report("evaluation", 1.0, f"dense model: figures reused from its evaluation of {measured_at}")
        figures = Figures(**{name: kept["figures"][name] for name in KEPT_FIGURES}, reused_from=measured_at)
        if plan.efficiency is not None:
            with run.stage(DENSE_STAGE):
                efficiency_only = replace(plan, texts={}, zero_shot=[])
                figures.efficiency = evaluate(model, tokenizer, efficiency_only, run).efficiency
        return figures
    with run.stage(DENSE_STAGE):
        started = time.perf_counter()
        figures = evaluate(model, tokenizer, plan, run)
        seconds = time.perf_counter() - started
    try:
        write_entry(entry, key, figures, seconds)
    except OSError as error:  # a cache that cannot be written costs the next job the evaluation, not this job
        run.warn(f"the dense model's evaluation was not kept for later jobs: {error.strerror or error}")
    return figures


def evaluation_key(model: PreTrainedModel, plan: EvaluationPlan, folder: Path) -> dict[str, Any]:
    """What the dense model's figures depend on (the module docstring), as JSON values."""
    versions = library_versions()
    libraries = ("torch", "transformers", *(("lm_eval",) if plan.zero_shot else ()))
    return {
        "evaluation_version": EVALUATION_VERSION,
        # transformers records the folder from_pretrained read; casp_core.model.load_model always hands it a local
        # one: the hub snapshot, the folder a GGUF file was dequantized into, or the user's.
        "source": source_identity(Path(model.config.name_or_path), folder),
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": resolve_device(plan.device).type,
        # Not the perplexity's batch size (the calibration's): each window is scored on its own, so it sets how many
        # go through the model at once (and the last bits of the sums), not what is measured.
        "texts": {
            name: {**text.convention, "tokens_sha256": hashlib.sha256(text.windows.numpy().tobytes()).hexdigest()}
            for name, text in plan.texts.items()
        },
        "zero_shot": {
            "tasks": plan.zero_shot,
            "limit": plan.limit,
            "batch_size": plan.zero_shot_batch_size,
            "datasets_dir": plan.datasets_dir,
        }
        if plan.zero_shot
        else None,
        "libraries": {name: versions[name] for name in libraries},
    }


def source_identity(source: Path, folder: Path) -> dict[str, str]:
    """Which model `source` (a local folder) holds: the GGUF file it was dequantized from, the hub commit its
    snapshot is, or the digest of its files (remembered in `folder` by path, size and modification time)."""
    gguf = source_of(source)
    if gguf is not None:
        return {"gguf_sha256": gguf.sha256}
    source = source.resolve()
    # The Hugging Face cache's layout: models--<org>--<name>/snapshots/<commit>.
    if source.parent.name == "snapshots" and source.parent.parent.name.startswith("models--"):
        repository = source.parent.parent.name.removeprefix("models--").replace("--", "/")
        return {"hub": repository, "commit": source.name}
    files = sorted(path for path in source.iterdir() if path.is_file() and path.suffix in MODEL_FILE_SUFFIXES)
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{remembered_sha256(path, folder / FILE_DIGESTS)}\0".encode())
    return {"folder_sha256": digest.hexdigest()}


def remembered_sha256(path: Path, digests: Path) -> str:
    """The file's sha256, read once per (path, size, modification time) and remembered in `digests`."""
    stat = path.stat()
    memo = digests / key_digest([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    sha256 = file_sha256(path)
    with suppress(OSError):  # unremembered, it is read again by the next job
        _write_whole(memo, sha256)
    return sha256


def read_entry(entry: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The entry kept for `key`; None when there is none, or it cannot be read, or it holds another key."""
    try:
        kept = json.loads(entry.read_text())
        if kept["key"] != _as_json(key):
            return None
        if not isinstance(kept["measured_at"], str) or not all(name in kept["figures"] for name in KEPT_FIGURES):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return kept


def write_entry(entry: Path, key: dict[str, Any], figures: Figures, seconds: float) -> None:
    kept = {
        "key": key,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": seconds,
        "figures": {name: asdict(figures)[name] for name in KEPT_FIGURES},
    }
    _write_whole(entry, json.dumps(kept, indent=2) + "\n")


def _write_whole(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed over it: a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)


def _as_json(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples as lists), to compare with an entry's."""
    return json.loads(json.dumps(value))
