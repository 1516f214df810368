"""`casp upgrade CHECKPOINT`: a checkpoint that casp handed out earlier, brought to the current pruned model class.

A per-layer checkpoint runs the copy of modeling_casp_llama.py it carries (config.json's auto_map), so a fix to the
class reaches it only when that copy is replaced. casp 0.1.0's copy reads the cache as `past_key_values`, which
transformers >= 5.24 passes as `cache`: generation with the cache (the default) goes wrong there, while the
uncached forward and the GGUF export stay right.

The upgrade rewrites config.json, through the current config class of its pruned model type (CaspLlamaConfig
for casp_llama, the family's own for another; every per-layer setting kept; auto_map and
the class's own settings as it writes them now), and the modeling file; the weights are never opened for writing.
The files it replaces go to `upgrade-backup/<UTC time>/` inside the checkpoint first. It is verified the way a
user loads the checkpoint, in fresh processes (casp_core.artifacts.probe): before, the old files' uncached logits;
after, the upgraded checkpoint must load, give those logits, and generate the same greedy tokens with the cache as
without it. If not, the old files are put back and the error says why.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import __version__ as transformers_version
from transformers.dynamic_module_utils import custom_object_save

import casp_core
from casp_core.artifacts import probe
from casp_core.errors import CheckpointNotWritable, ModelNotFound, UnsupportedModel, VerificationFailed
from casp_core.families import family_of, is_pruned_model_type

CONFIG_FILE = "config.json"
BACKUP_DIR = "upgrade-backup"
# Of the largest |logit|: float32 on both sides, the same weights and the same arithmetic up to the order of sums.
LOGIT_TOLERANCE = 1e-5
# The directory that holds the casp_core package: the probe's process imports it from there.
SOURCE_ROOT = Path(casp_core.__file__).resolve().parents[1]


def current_files(checkpoint: Path) -> dict[str, bytes]:
    """config.json and the modeling file, as the current class writes them for this checkpoint's config."""
    # The model is built on the meta device (no memory, no weights) to state its class in auto_map as
    # save_pretrained does, and to check that the current class builds every layer this config describes.
    model_type = json.loads((checkpoint / CONFIG_FILE).read_text(encoding="utf-8")).get("model_type")
    model_class = family_of(model_type).pruned_model_class
    try:
        config = model_class.config_class.from_pretrained(checkpoint)
        with torch.device("meta"):
            model = model_class(config)
    except (ValueError, TypeError, KeyError, IndexError) as error:
        message = f"{checkpoint}: the current {model_type} class cannot read its {CONFIG_FILE}: {error}"
        raise UnsupportedModel(message) from error
    config.auto_map = {}  # only the current classes' entries
    with tempfile.TemporaryDirectory() as staging:
        custom_object_save(model, staging, config=config)
        config.save_pretrained(staging)
        return {path.name: path.read_bytes() for path in sorted(Path(staging).iterdir()) if path.is_file()}


def run_probe(checkpoint: Path) -> dict[str, torch.Tensor]:
    """casp_core.artifacts.probe's measurements, in a fresh process with stdin closed."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "probe.safetensors"
        # transformers keeps a local checkpoint's modeling file under its modules cache by the folder's name
        # alone, shared with every other folder of that name on the machine: the probe gets a cache of its own.
        env = {
            **os.environ,
            "HF_MODULES_CACHE": str(Path(scratch) / "modules"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")])),
        }
        completed = subprocess.run(
            [sys.executable, "-m", probe.__name__, str(checkpoint), str(out)],
            env=env,
            cwd=scratch,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        if completed.returncode != 0:
            lines = completed.stderr.strip().splitlines()
            raise VerificationFailed(lines[-1] if lines else f"the probe exited with status {completed.returncode}")
        return load_file(out)


def compare(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """The largest logit difference after against before; raises if the upgraded checkpoint is not right."""
    difference = (after["logits"] - before["logits"]).abs().max().item()
    scale = before["logits"].abs().max().item()
    if not difference <= LOGIT_TOLERANCE * scale:  # NaN fails too
        raise VerificationFailed(
            f"the upgraded checkpoint's uncached logits differ from the old ones by up to {difference:.3g} "
            f"(largest logit {scale:.3g}, tolerance {LOGIT_TOLERANCE:g} of it)"
        )
    if not torch.equal(after["cached"], after["uncached"]):
        raise VerificationFailed(
            "the upgraded checkpoint generates other greedy tokens with the cache than without it "
            f"(transformers {transformers_version})"
        )
    return difference


def restore(checkpoint: Path, backup: Path, written: list[str]) -> None:
    """The checkpoint as it was before the upgrade: its old files back, files it did not have removed."""
    for name in written:
        if (backup / name).is_file():
            shutil.copy2(backup / name, checkpoint / name)
        else:
            (checkpoint / name).unlink(missing_ok=True)
    shutil.rmtree(backup)
    if not any(backup.parent.iterdir()):
        backup.parent.rmdir()


def upgrade_checkpoint(checkpoint: Path) -> dict[str, Any]:
    """Upgrades `checkpoint` in place; returns what was done, for the command's one JSON line."""
    checkpoint = checkpoint.resolve()
    config_path = checkpoint / CONFIG_FILE
    if not config_path.is_file():
        raise ModelNotFound(f"{checkpoint} is not a checkpoint directory (no {CONFIG_FILE})")
    try:
        settings = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelNotFound(f"{config_path} is not a JSON config: {error}") from error
    summary: dict[str, Any] = {"checkpoint": str(checkpoint), "transformers": transformers_version}
    model_type = settings.get("model_type")
    if not is_pruned_model_type(model_type):
        classes = ", ".join(settings.get("architectures") or []) or "no architecture named"
        message = (
            f"not a casp per-layer checkpoint: model_type {model_type!r} ({classes}) loads with transformers' own "
            "class and carries no modeling file; nothing to upgrade"
        )
        return {**summary, "status": "not_casp", "message": message}

    files = current_files(checkpoint)
    written = [name for name, content in files.items() if not _holds(checkpoint / name, content)]
    if not written:
        return {**summary, "status": "up_to_date", "message": "config.json and the modeling file are current"}
    try:
        before = run_probe(checkpoint)
    except VerificationFailed as error:
        message = f"{checkpoint} does not run as it is ({error.message}); nothing was changed"
        raise VerificationFailed(message) from error
    backup = checkpoint / BACKUP_DIR / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    replaced: list[str] = []  # put back if writing fails midway: only what was already overwritten
    try:
        backup.mkdir(parents=True)
        for name in written:
            if (checkpoint / name).is_file():
                shutil.copy2(checkpoint / name, backup / name)
        for name in written:
            replaced.append(name)
            (checkpoint / name).write_bytes(files[name])
    except OSError as error:
        if backup.is_dir():
            restore(checkpoint, backup, replaced)
        raise CheckpointNotWritable(
            f"cannot upgrade {checkpoint} in place: {error.strerror or error} ({error.filename}); nothing was changed"
        ) from error
    try:
        difference = compare(before, run_probe(checkpoint))
    except VerificationFailed as error:
        restore(checkpoint, backup, written)
        raise VerificationFailed(f"upgrade of {checkpoint} failed: {error.message}; the old files are back") from error
    return {
        **summary,
        "status": "upgraded",
        "message": f"rewrote {', '.join(written)}; the old files are in {backup}",
        "files": written,
        "backup": str(backup),
        "max_logit_difference": difference,
        "cached_generation_was_right": torch.equal(before["cached"], before["uncached"]),
    }


def _holds(path: Path, content: bytes) -> bool:
    return path.is_file() and path.read_bytes() == content
