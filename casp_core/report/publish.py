"""What a published checkpoint directory says about where it came from: local files by their name only.

The directory is meant to be uploaded as it is (`huggingface-cli upload`), so nothing in it may carry an absolute
path of the machine that made it: a local model, data set file or data set folder is named by its last part.
"""

import json
from pathlib import Path
from typing import Any

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from casp_core.model import is_local_reference

# The Hugging Face cache keeps a repository's files under models--<org>--<name>/snapshots/<commit>/.
HUB_CACHE_PREFIX = "models--"


def public_name(reference: str) -> str:
    """A Hugging Face id as it is; a local path as its last part (`/data/models/llama-7b/` -> `llama-7b`)."""
    return Path(reference).expanduser().name if is_local_reference(reference) else reference


def without_local_paths(value: Any) -> Any:
    """`value` (JSON-like: dicts, lists, strings, numbers) with every string that is a local path, keys included,
    replaced by its `public_name`."""
    if isinstance(value, str):
        return public_name(value)
    if isinstance(value, dict):
        return {without_local_paths(key): without_local_paths(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [without_local_paths(item) for item in value]
    return value


def _hub_id(candidate: Any) -> str | None:
    if not isinstance(candidate, str) or not candidate or is_local_reference(candidate):
        return None
    try:
        validate_repo_id(candidate)
    except HFValidationError:
        return None
    return candidate


def base_model_of(reference: str) -> str | None:
    """The Hugging Face id of the model `reference` names, or None when it is a local model of unknown origin.

    A hub id is its own. A local folder is known by what it records: a CASP checkpoint's `casp.base_model`, a
    `_name_or_path` that is a hub id, or the Hugging Face cache's folder layout it sits in.
    """
    if not is_local_reference(reference):
        return reference
    folder = Path(reference).expanduser().resolve()
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    casp = config.get("casp") if isinstance(config.get("casp"), dict) else {}
    recorded = _hub_id(casp.get("base_model")) or _hub_id(config.get("_name_or_path"))
    if recorded:
        return recorded
    if len(folder.parts) >= 3 and folder.parent.name == "snapshots" and folder.parts[-3].startswith(HUB_CACHE_PREFIX):
        return _hub_id(folder.parts[-3].removeprefix(HUB_CACHE_PREFIX).replace("--", "/", 1))
    return None
