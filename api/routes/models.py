"""/v1/models: models a key uploads (a tar of the model's folder, or a GGUF file), for its jobs to prune as
`casp://models/<id>`."""

import re
import shutil
import tarfile
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Annotated, BinaryIO, Literal

from fastapi import APIRouter, Body, File, Form, HTTPException, Query, Response, UploadFile, status
from fastapi.exceptions import RequestValidationError
from sqlalchemy.orm import Session

from api.deps import CallerDep, SessionDep, SettingsDep, StorageDep
from api.errors import responses
from api.json_body import JsonRoute
from api.routes.jobs import invalid, resolve_model, retention_of
from api.schemas import (
    MODEL_NAME_PATTERN,
    JobCreate,
    JobIdText,
    ModelCheckOut,
    ModelChoice,
    ModelChoiceList,
    ModelId,
    ModelList,
    ModelOut,
    PresignedUploadIn,
    PresignedUploadOut,
)
from casp_core.artifacts.gguf.source import GGUF_MAGIC, GGUF_SUFFIX, is_gguf_reference
from casp_core.errors import CaspError
from casp_core.model import check_model_folder, load_config
from service import api_keys, uploaded_models
from service.paths import UPLOAD_SCHEME, local_models
from service.settings import Settings
from service.storage import S3Storage, Storage, files_of
from service.tables import PendingUpload, UploadedModel, aware, new_id, utcnow

router = APIRouter(prefix="/v1/models", tags=["models"], responses=responses(401, 422), route_class=JsonRoute)

ARCHIVE = ("file",)
# A model folder has a config, weights, a tokenizer: a few dozen files even sharded.
MAX_FILES = 1000
# A presigned upload's tar may be completed this long after its URL expired (a large PUT started in time).
PENDING_GRACE = timedelta(days=1)
PACKING_HINT = "pack the model's folder as `tar -C FOLDER -cf model.tar .` (or `casp models upload FOLDER`)"
# A model checked and ready to store: its folder or GGUF file, its name and its model type.
Received = tuple[Path, str, str]


def scratch_of(settings: Settings) -> Path:
    """Where archives are read and unpacked: a folder of the server's own, not the system's /tmp."""
    scratch = settings.home / "uploads"
    scratch.mkdir(parents=True, exist_ok=True)
    return scratch


def model_out(row: UploadedModel) -> ModelOut:
    return ModelOut(
        id=row.id,
        model=f"{UPLOAD_SCHEME}{row.id}",
        name=row.name,
        model_type=row.model_type,
        size=row.size,
        files=row.files,
        created_at=aware(row.created_at),  # type: ignore[arg-type]
        expires_at=aware(row.expires_at),  # type: ignore[arg-type]
    )


def unpack(archive: BinaryIO, target: Path, max_bytes: int) -> Path:
    """The model folder the tar holds: its files at the top, or one folder at the top holding them. Links, devices
    and names leaving `target` are refused (tarfile's "data" filter), and so is more than `max_bytes` unpacked."""
    try:
        with tarfile.open(fileobj=archive, mode="r:*") as tar:
            members = tar.getmembers()
            strange = next((m.name for m in members if not (m.isfile() or m.isdir())), None)
            if strange is not None:
                raise invalid(ARCHIVE, f"{strange[:100]!r} is not a file or a folder; a model folder holds files")
            if len(members) > MAX_FILES:
                raise invalid(ARCHIVE, f"more than {MAX_FILES} files: not a model folder")
            if sum(m.size for m in members) > max_bytes:
                raise invalid(ARCHIVE, f"unpacked, larger than {max_bytes} bytes (CASP_MAX_UPLOAD_BYTES)")
            tar.extractall(target, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:  # EOFError and zlib's OSError: a truncated archive
        raise invalid(ARCHIVE, f"not a readable tar archive ({type(exc).__name__}: {exc}); {PACKING_HINT}") from exc
    if (target / "config.json").is_file():
        return target
    top = list(target.iterdir())
    if len(top) == 1 and (top[0] / "config.json").is_file():
        return top[0]
    raise invalid(ARCHIVE, f"no config.json at the top of the archive; {PACKING_HINT}")


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ModelOut, responses=responses(400, 413))
def upload_model(
    file: Annotated[
        UploadFile,
        File(
            description="the model's folder as a tar archive (optionally gzip-compressed), or a GGUF file (named"
            " `*.gguf`, or starting with the GGUF magic bytes)"
        ),
    ],
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
    storage: StorageDep,
    name: Annotated[
        str | None,
        Form(
            pattern=MODEL_NAME_PATTERN,
            description="the model's name (its pruned model card's); default: the archive's top folder, or `model`;"
            " a GGUF file's ends in `.gguf` (added when missing; default: the file's name)",
        ),
    ] = None,
    retention_seconds: Annotated[
        int | None,
        Form(gt=0, description="how long it is kept; default CASP_ARTIFACT_RETENTION_SECONDS, at most the maximum"),
    ] = None,
) -> ModelOut:
    """Checked before it is kept: a config of a supported family, a tokenizer, and safetensors weights whose
    tensors and shapes are the config's (read from the files' headers); a GGUF file's header as a job's `model` is
    checked. Otherwise 422 on `file`, saying why."""
    retention = retention_of(retention_seconds, settings)
    row = accept_upload(file.file, name, file.filename, retention, new_id(), session, caller, settings, storage)
    session.commit()
    return model_out(row)


def is_gguf_upload(upload: BinaryIO, *names: str | None) -> bool:
    """A GGUF file rather than a tar: named `*.gguf` (the model's name or the file's), or starting with GGUF's magic
    bytes."""
    if any(name is not None and is_gguf_reference(name) for name in names):
        return True
    start = upload.read(len(GGUF_MAGIC))
    upload.seek(0)
    return start == GGUF_MAGIC


def checked_name(chosen: str, what: str) -> str:
    if not re.match(MODEL_NAME_PATTERN, chosen):
        raise invalid(("name",), f"{what} {chosen[:100]!r} is no model name: give `name`")
    return chosen


def receive_folder(archive: BinaryIO, name: str | None, scratch: Path, max_bytes: int) -> Received:
    """The model folder the tar holds, checked by casp_core; 422 on `file` or `name`."""
    folder = unpack(archive, scratch, max_bytes)
    chosen = checked_name(name or (folder.name if folder != scratch else "model"), "the archive's folder")
    if is_gguf_reference(chosen):  # the worker would take the folder for a GGUF file
        raise invalid(("name",), f"a model folder's name does not end in {GGUF_SUFFIX}: give another `name`")
    try:
        config = check_model_folder(folder)
    except CaspError as exc:
        # casp_core names the folder it read: the server's scratch path is not the caller's to see.
        raise invalid(ARCHIVE, f"{exc.code}: {exc.message.replace(str(folder), chosen)}") from exc
    return folder, chosen, config.model_type


def receive_gguf(upload: BinaryIO, name: str | None, file_name: str | None, scratch: Path) -> Received:
    """The GGUF file, checked from its header as a job's `model` is at submit; 422 on `file` or `name`."""
    base = name or (file_name if file_name and is_gguf_reference(file_name) else "model")
    chosen = checked_name(base if is_gguf_reference(base) else base + GGUF_SUFFIX, "the file's name")
    path = scratch / chosen
    with path.open("wb") as copy:
        shutil.copyfileobj(upload, copy)
    try:
        config = load_config(str(path))
    except CaspError as exc:
        raise invalid(ARCHIVE, f"{exc.code}: {exc.message.replace(str(path), chosen)}") from exc
    return path, chosen, config.model_type


def accept_upload(
    upload: BinaryIO,
    name: str | None,
    file_name: str | None,
    retention: int,
    model_id: str,
    session: Session,
    caller: api_keys.Caller,
    settings: Settings,
    storage: Storage,
) -> UploadedModel:
    """The upload (a tar, or a GGUF file: `file_name` is the multipart file's name) checked, stored as the model
    `model_id` and recorded (uncommitted); 422 on `file` or `name`."""
    with tempfile.TemporaryDirectory(dir=scratch_of(settings)) as unpacked:
        if is_gguf_upload(upload, name, file_name):
            source, chosen, model_type = receive_gguf(upload, name, file_name, Path(unpacked))
            files, size = 1, source.stat().st_size
        else:
            source, chosen, model_type = receive_folder(upload, name, Path(unpacked), settings.max_upload_bytes)
            stored = files_of(source)
            files, size = len(stored), sum(path.stat().st_size for _, path in stored)
        storage.put_model(model_id, chosen, source)
    return uploaded_models.add_owned(
        session,
        caller,
        UploadedModel,
        id=model_id,
        name=chosen,
        model_type=model_type,
        size=size,
        files=files,
        expires_at=utcnow() + timedelta(seconds=retention),
    )


def finish_pending(session: Session, bucket: S3Storage, upload_id: str) -> None:
    """The pending upload done with, accepted or refused: its tar and its row go."""
    bucket.delete_pending_upload(upload_id)
    uploaded_models.forget_pending_upload(session, upload_id)
    session.commit()


def s3_storage(storage: Storage) -> S3Storage:
    if not isinstance(storage, S3Storage):
        raise HTTPException(
            status.HTTP_400_BAD_REQUEST,
            "presigned uploads need S3 storage (CASP_STORAGE_URL=s3://...); this server takes the tar as a multipart"
            " upload to POST /v1/models",
        )
    return storage


@router.post(
    "/presigned",
    status_code=status.HTTP_201_CREATED,
    response_model=PresignedUploadOut,
    responses=responses(400),
)
def presign_upload(
    body: PresignedUploadIn, session: SessionDep, caller: CallerDep, settings: SettingsDep, storage: StorageDep
) -> PresignedUploadOut:
    """A URL to PUT the model's tar (or GGUF file: name it `*.gguf`) to, straight into the artifact bucket, then
    `POST /v1/models/{id}/complete`, which checks it as `POST /v1/models` checks a multipart upload. The URL expires
    after CASP_URL_TTL_SECONDS; a file not completed within a day after that is deleted. S3 storage only (400
    otherwise)."""
    bucket = s3_storage(storage)
    retention = retention_of(body.retention_seconds, settings)
    now = utcnow()
    row = uploaded_models.add_owned(
        session,
        caller,
        PendingUpload,
        name=body.name,
        retention_seconds=retention,
        expires_at=now + timedelta(seconds=settings.url_ttl_seconds) + PENDING_GRACE,
    )
    url = bucket.pending_upload_url(row.id, settings.url_ttl_seconds)
    session.commit()
    return PresignedUploadOut(
        id=row.id,
        upload_url=url,
        upload_method="PUT",
        upload_expires_at=now + timedelta(seconds=settings.url_ttl_seconds),
        complete_url=f"/v1/models/{row.id}/complete",
    )


@router.post(
    "/{upload_id}/complete",
    status_code=status.HTTP_201_CREATED,
    response_model=ModelOut,
    responses=responses(400, 404, 409),
)
def complete_upload(
    upload_id: ModelId, session: SessionDep, caller: CallerDep, settings: SettingsDep, storage: StorageDep
) -> ModelOut:
    """Checks the tar (or GGUF file) PUT to the presigned URL as a multipart upload is checked; 201 with the model
    (the upload's id), or 422 on `file` with the reason. Either way the upload is done with: a refused file is
    deleted, and a new presigned upload starts again. 409 while nothing was PUT; 404 for an unknown, expired or
    another key's id."""
    bucket = s3_storage(storage)
    pending = uploaded_models.get_pending_upload(session, caller, upload_id)
    if pending is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no pending upload {upload_id}")
    size = bucket.pending_upload_size(pending.id)
    if size is None:
        raise HTTPException(status.HTTP_409_CONFLICT, "nothing was uploaded yet: PUT the tar to the upload's URL first")
    try:
        if size > settings.max_upload_bytes:
            raise invalid(ARCHIVE, f"larger than {settings.max_upload_bytes} bytes (CASP_MAX_UPLOAD_BYTES)")
        with tempfile.TemporaryFile(dir=scratch_of(settings)) as archive:
            bucket.read_pending_upload(pending.id, archive)
            archive.seek(0)
            row = accept_upload(
                archive, pending.name, None, pending.retention_seconds, pending.id, session, caller, settings, storage
            )
    except RequestValidationError:
        finish_pending(session, bucket, pending.id)
        raise
    finish_pending(session, bucket, pending.id)
    return model_out(row)


@router.get("", response_model=ModelList)
def list_models(
    session: SessionDep,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[JobIdText | None, Query(description="id of the last model of the previous page")] = None,
) -> ModelList:
    rows, has_more = uploaded_models.list_uploaded_models(session, caller, limit=limit, after=after)
    return ModelList(data=[model_out(row) for row in rows], has_more=has_more)


# The uploads a listing of choices names at most (a page of GET /v1/models).
UPLOAD_CHOICES = 100


def format_of(name: str) -> Literal["folder", "gguf"]:
    return "gguf" if is_gguf_reference(name) else "folder"


@router.get("/choices", response_model=ModelChoiceList)
def model_choices(session: SessionDep, caller: CallerDep, settings: SettingsDep) -> ModelChoiceList:
    """The models this key can name as a job's `model`: its uploads, then the models found under
    CASP_ALLOWED_MODEL_ROOTS (a folder holding config.json, or a `.gguf` file; each root, its folders and theirs).
    Found by their names: whether a job takes one, POST /v1/models/check says."""
    rows, more_uploads = uploaded_models.list_uploaded_models(session, caller, limit=UPLOAD_CHOICES, after=None)
    found, more_local = local_models(settings.model_roots())
    uploads = [
        ModelChoice(model=model_out(row).model, name=row.name, source="upload", format=format_of(row.name))
        for row in rows
    ]
    local = [
        ModelChoice(
            model=str(path), name=str(path.relative_to(root.parent)), source="local", format=format_of(path.name)
        )
        for root, path in found
    ]
    return ModelChoiceList(data=uploads + local, truncated=more_uploads or more_local)


@router.post("/check", response_model=ModelCheckOut, responses=responses(503))
def check_job_model(
    body: Annotated[
        JobCreate, Body(description="a job as POST /v1/jobs takes it; `model` alone checks the model by itself")
    ],
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
) -> ModelCheckOut:
    """What POST /v1/jobs would say about the job's model, without making a job: 200 with the model as the job
    would store it, or the very 422 the submit would answer (naming `model`, or the setting the model cannot take).
    A Hugging Face id is checked for its form only, as at submit: the worker fetches it."""
    return ModelCheckOut(model=resolve_model(body, settings, session, caller))


@router.delete("/{model_id}", status_code=status.HTTP_204_NO_CONTENT, responses=responses(404))
def delete_model(model_id: ModelId, session: SessionDep, caller: CallerDep, storage: StorageDep) -> Response:
    """Deletes the model now; a queued job that names it fails with `model_not_found` when it starts."""
    row = uploaded_models.get_uploaded_model(session, caller, model_id)
    if row is None:  # another key's answers exactly like a missing one
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no uploaded model {model_id}")
    storage.delete_model(row.id)
    uploaded_models.forget_upload(session, row.id)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
