"""Where a job may read its model and text from. The API checks at submit, and the worker again before it runs
(a row may have been written past the API): a local path (a model folder, a `.gguf` file) must be absolute and,
with symbolic links and `..` resolved, lie under CASP_ALLOWED_MODEL_ROOTS (data set files: or CASP_DATASETS_DIR); a
model in a bucket, `s3://bucket/prefix` (a folder, or one `.gguf` object), must lie under one of
CASP_ALLOWED_MODEL_BUCKETS; `casp://models/<id>` is a model the job's key uploaded (whose owner the API and the
worker check against the uploads' table); anything else is a Hugging Face id, which casp_core loads from the hub
cache only, or a named data set installed under the datasets dir."""

import os
import re
from collections.abc import Callable
from pathlib import Path

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from casp_core.artifacts.gguf.source import is_gguf_reference
from casp_core.data import LOCAL_FILES, TextSource, calibration_source, evaluation_source, local_copy, parse_source
from casp_core.errors import CaspError, DatasetNotFound, InvalidDataset, ModelNotFound
from casp_core.model import is_local_reference
from casp_core.recovery.data import TRAINING_SPLIT, read_training_file
from casp_core.settings import PruneConfig
from service.settings import Settings

DATASET_FILE_SUFFIXES = (".txt", ".jsonl")
# Recovery also reads Alpaca's own .json array.
TRAINING_FILE_SUFFIXES = (".txt", ".jsonl", ".json")

# The longest file name and path this system takes, in bytes (PATH_MAX counts the terminating NUL).
NAME_MAX = os.pathconf("/", "PC_NAME_MAX")
PATH_MAX = os.pathconf("/", "PC_PATH_MAX")

Loc = tuple[str | int, ...]
RECOVERY_DATASET: Loc = ("recovery", "dataset")

S3_SCHEME = "s3://"
UPLOAD_SCHEME = "casp://models/"
# S3's bucket naming rules (3 to 63 lower-case letters, digits, dots and hyphens, a letter or digit at each end).
BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
UPLOAD_ID = re.compile(r"^[0-9a-f]{32}$")

# Messages quote at most this much of a caller's input (the API's error answers too).
EXCERPT_CHARS = 64


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """At most `limit` characters of a caller's input, for a message."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"


class InputRefused(CaspError):
    """A model or data set the job may not read; `loc` is the request field, `code` the job's error code."""

    code = "input_not_allowed"

    def __init__(self, loc: Loc, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.loc = loc
        if code:
            self.code = code


def _check_lengths(value: str, loc: Loc) -> None:
    """The file system's own limits, checked before it is asked (it would answer ENAMETOOLONG)."""
    encoded = os.fsencode(value)
    if len(encoded) >= PATH_MAX:
        raise InputRefused(loc, f"the path is longer than the system's limit of {PATH_MAX - 1} bytes")
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        raise InputRefused(loc, f"a path component is longer than the system's limit of {NAME_MAX} bytes")


def _under_roots(value: str, loc: Loc, roots: list[Path], roots_setting: str) -> Path:
    if not value.startswith("/"):
        raise InputRefused(loc, "local paths must be absolute")
    _check_lengths(value, loc)
    # Resolved first, so `..` and symbolic links cannot lead outside the allowed roots.
    path = Path(value).resolve()
    _check_lengths(str(path), loc)  # symbolic links may lead somewhere longer
    if not any(path.is_relative_to(root) for root in roots):
        allowed = ":".join(map(str, roots)) or "none configured"
        raise InputRefused(loc, f"local paths must lie under {roots_setting} ({allowed})")
    return path


def is_remote_model(model: str) -> bool:
    """A model the worker fetches into a local folder before casp_core loads it."""
    return model.startswith((S3_SCHEME, UPLOAD_SCHEME))


def bucket_and_prefix(reference: str) -> tuple[str, list[str]]:
    """`s3://bucket/some/prefix` as ("bucket", ["some", "prefix"]); a prefix's parts are folder names, never empty,
    `.` or `..` (S3 would take them as they are; a local folder made from them would not)."""
    bucket, _, prefix = reference.removeprefix(S3_SCHEME).partition("/")
    if not BUCKET_NAME.match(bucket):
        raise InputRefused(("model",), f"not an S3 bucket name: {excerpt(bucket)}")
    parts = prefix.rstrip("/").split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise InputRefused(("model",), "an S3 model is `s3://bucket/prefix`, the prefix's parts not empty, . or ..")
    return bucket, parts


def check_s3_model(reference: str, settings: Settings) -> str:
    """`s3://bucket/prefix` under one of the allowed buckets and prefixes, without a trailing slash."""
    bucket, parts = bucket_and_prefix(reference)
    for entry in settings.allowed_model_buckets:
        allowed_bucket, _, allowed_prefix = entry.partition("/")
        allowed_parts = [part for part in allowed_prefix.split("/") if part]
        if bucket == allowed_bucket and parts[: len(allowed_parts)] == allowed_parts:
            return f"{S3_SCHEME}{bucket}/{'/'.join(parts)}"
    allowed = ", ".join(settings.allowed_model_buckets) or "none configured"
    raise InputRefused(("model",), f"S3 models must lie under CASP_ALLOWED_MODEL_BUCKETS ({allowed})")


def upload_id_of(reference: str) -> str:
    model_id = reference.removeprefix(UPLOAD_SCHEME)
    if not UPLOAD_ID.match(model_id):
        raise InputRefused(("model",), "an uploaded model is `casp://models/<id>`, with the id POST /v1/models gave")
    return model_id


def check_model(model: str, settings: Settings) -> str:
    """The model as the job stores it: a hub id as given, a local folder or GGUF file resolved, a bucket's prefix
    normalised. An upload's id is checked for its form only: whose it is, the caller checks."""
    if model.startswith(S3_SCHEME):
        return check_s3_model(model, settings)
    if model.startswith(UPLOAD_SCHEME):
        upload_id_of(model)
        return model
    if not is_local_reference(model):
        try:
            validate_repo_id(model)
        except HFValidationError as exc:
            raise InputRefused(("model",), f"not a Hugging Face id: {exc}") from exc
        return model
    path = _under_roots(model, ("model",), settings.model_roots(), "CASP_ALLOWED_MODEL_ROOTS")
    if is_gguf_reference(model):
        if not path.is_file():
            raise InputRefused(("model",), "no such GGUF file", ModelNotFound.code)
        if not is_gguf_reference(path.name):
            # A link to a file of another name (the Hugging Face cache links each file to a blob named by its
            # digest): the job keeps the link's name, which says it is GGUF; its target was checked above.
            return str(Path(model).parent.resolve() / Path(model).name)
    elif not path.is_dir():
        raise InputRefused(("model",), "no such model folder", ModelNotFound.code)
    return str(path)


# How deep under an allowed root models are looked for (its folders, and theirs), and how many are listed at most.
LISTING_DEPTH = 2
LISTING_LIMIT = 200


def local_models(roots: list[Path], limit: int = LISTING_LIMIT) -> tuple[list[tuple[Path, Path]], bool]:
    """The models found under the allowed roots, as (root, path), by their names alone (nothing is read): each
    root, its folders and theirs (LISTING_DEPTH), a folder holding config.json being a model (and not looked into),
    a file named `.gguf` another; hidden names skipped. At most `limit`, and whether more were found."""
    found: list[tuple[Path, Path]] = []

    def walk(root: Path, folder: Path, depth: int) -> None:
        if (folder / "config.json").is_file():
            found.append((root, folder))
            return
        if depth == LISTING_DEPTH:
            return
        try:
            entries = sorted(entry for entry in folder.iterdir() if not entry.name.startswith("."))
        except OSError:  # unreadable: nothing to list there
            return
        for entry in entries:
            if len(found) > limit:
                return
            if entry.is_dir():
                walk(root, entry, depth + 1)
            elif is_gguf_reference(entry.name) and entry.is_file():
                found.append((root, entry))

    for root in roots:
        walk(root, root, 0)
    return found[:limit], len(found) > limit


def check_dataset(
    spec: str,
    loc: Loc,
    settings: Settings,
    source_of: Callable[[str], TextSource],
    suffixes: tuple[str, ...] = DATASET_FILE_SUFFIXES,
) -> str:
    """A named set (`name[:split]`, installed under the datasets dir when there is one) or a file under the
    allowed roots: anything else casp_core would read as a path relative to the worker's directory."""
    if spec.partition(":")[0] in LOCAL_FILES:
        try:
            source = source_of(spec)
            if settings.datasets_dir:
                local_copy(source, str(settings.datasets_dir))
        except DatasetNotFound as exc:
            raise InputRefused(loc, exc.message, DatasetNotFound.code) from exc
        return spec
    if Path(spec).suffix not in suffixes:
        known = ", ".join(LOCAL_FILES)
        raise InputRefused(loc, f"must be one of {known} (optionally `:split`) or a {' or '.join(suffixes)} file")
    roots = settings.model_roots() + ([settings.datasets_dir.resolve()] if settings.datasets_dir else [])
    path = _under_roots(spec, loc, roots, "CASP_ALLOWED_MODEL_ROOTS or CASP_DATASETS_DIR")
    if not path.is_file():
        raise InputRefused(loc, f"no such file: {excerpt(spec)}", DatasetNotFound.code)
    return str(path)


def training_source(spec: str) -> TextSource:
    return parse_source(spec, TRAINING_SPLIT)


def check_training_data(spec: str, settings: Settings) -> str:
    """Recovery's data set, a user's file read in full: bad records are refused at submit, naming where."""
    checked = check_dataset(spec, RECOVERY_DATASET, settings, training_source, TRAINING_FILE_SUFFIXES)
    if checked.partition(":")[0] not in LOCAL_FILES:
        try:
            read_training_file(Path(checked))
        except InvalidDataset as exc:
            raise InputRefused(RECOVERY_DATASET, exc.message, InvalidDataset.code) from exc
    return checked


def check_job_inputs(model: str, config: PruneConfig, settings: Settings) -> None:
    """The worker's second look at what the job reads."""
    check_model(model, settings)
    check_dataset(config.calibration.dataset, ("calibration", "dataset"), settings, calibration_source)
    for i, spec in enumerate(config.evaluation.perplexity):
        check_dataset(spec, ("evaluation", "perplexity", i), settings, evaluation_source)
    if config.recovery.enabled:
        check_training_data(config.recovery.dataset, settings)
