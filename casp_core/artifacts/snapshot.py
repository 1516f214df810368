"""The pruned model kept for a retry of a job with recovery: after pruning and the pruned model's evaluation,
the job saves the pruned checkpoint with what its report still needs (the dense and pruned figures, the pruning
section, the warnings), and a later attempt given the same folder loads it and goes straight to recovery.

One tar file, written whole (renamed into place), so that a caller can copy it to its storage as one object.
"""

import json
import os
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.eval.evaluate import Figures
from casp_core.settings import PruneConfig

SNAPSHOT_FILE = "pruned-snapshot.tar"
CHECKPOINT = "checkpoint"
FACTS = "snapshot.json"


@dataclass
class PrunedSnapshot:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    dense_figures: Figures
    pruned_figures: Figures
    pruning: dict[str, Any]  # `pruning_section`'s, with the timings of the stages run before the save
    dtype: str  # the dense model's, for the report
    warnings: list[str]
    saved_at: str = ""  # ISO 8601, UTC; read back by load_snapshot (save_snapshot writes the time of the save)


def snapshot_fingerprint(model: str, revision: str | None, config: PruneConfig) -> dict[str, Any]:
    """What must match for a snapshot to be used: the model and every setting but recovery's (which acts after)."""
    settings = config.to_dict()
    settings.pop("recovery")
    return {"model": model, "revision": revision, "settings": settings}


def save_snapshot(directory: Path, fingerprint: dict[str, Any], snapshot: PrunedSnapshot) -> Path:
    """Writes `directory`/SNAPSHOT_FILE whole and returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    facts = {
        "fingerprint": fingerprint,
        "dense_figures": asdict(snapshot.dense_figures),
        "pruned_figures": asdict(snapshot.pruned_figures),
        "pruning": snapshot.pruning,
        "dtype": snapshot.dtype,
        "warnings": snapshot.warnings,
        "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    partial = directory / f".{SNAPSHOT_FILE}.partial"
    with tempfile.TemporaryDirectory(dir=directory) as work:
        save_pruned(snapshot.model, snapshot.tokenizer, Path(work) / CHECKPOINT)
        (Path(work) / FACTS).write_text(json.dumps(facts))
        with tarfile.open(partial, "w") as archive:
            archive.add(Path(work) / FACTS, FACTS)
            archive.add(Path(work) / CHECKPOINT, CHECKPOINT)
    os.replace(partial, directory / SNAPSHOT_FILE)
    return directory / SNAPSHOT_FILE


def load_snapshot(directory: Path, fingerprint: dict[str, Any]) -> PrunedSnapshot | None:
    """The snapshot in `directory` when there is one for the same model and settings, else None."""
    path = directory / SNAPSHOT_FILE
    if not path.is_file():
        return None
    with tempfile.TemporaryDirectory(dir=directory) as work, tarfile.open(path) as archive:
        archive.extract(FACTS, work, filter="data")
        facts = json.loads((Path(work) / FACTS).read_text())
        if facts["fingerprint"] != json.loads(json.dumps(fingerprint)):  # compared as read back from JSON
            return None
        archive.extractall(work, filter="data")
        model, tokenizer = load_pruned(Path(work) / CHECKPOINT)
    return PrunedSnapshot(
        model=model,
        tokenizer=tokenizer,
        dense_figures=Figures(**facts["dense_figures"]),
        pruned_figures=Figures(**facts["pruned_figures"]),
        pruning=facts["pruning"],
        dtype=facts["dtype"],
        warnings=facts["warnings"],
        saved_at=facts["saved_at"],
    )
