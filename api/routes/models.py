"""/v1/models: models a key uploads (a tar of the model's folder), for its jobs to prune as `casp://models/<id>`."""

import re
import tarfile
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Annotated, BinaryIO

from fastapi import APIRouter, File, Form, HTTPException, Query, Response, UploadFile, status
from fastapi.exceptions import RequestValidationError
from sqlalchemy.orm import Session

from api.deps import CallerDep, SessionDep, SettingsDep, StorageDep
from api.errors import responses
from api.json_body import JsonRoute
from api.routes.jobs import invalid, retention_of
from api.schemas import (
    MODEL_NAME_PATTERN,
    JobIdText,
    ModelId,
    ModelList,
    ModelOut,
    PresignedUploadIn,
    PresignedUploadOut,
)
from casp_core.errors import CaspError
from casp_core.model import check_model_folder
from service import jobs
from service.paths import UPLOAD_SCHEME
from service.settings import Settings
from service.storage import S3Storage, Storage, files_of
from service.tables import PendingUpload, UploadedModel, new_id, utcnow

router = APIRouter(prefix="/v1/models", tags=["models"], responses=responses(401, 422), route_class=JsonRoute)

ARCHIVE = ("file",)
# A model folder has a config, weights, a tokenizer: a few dozen files even sharded.
MAX_FILES = 1000
# A presigned upload's tar may be completed this long after its URL expired (a large PUT started in time).
PENDING_GRACE = timedelta(days=1)
PACKING_HINT = "pack the model's folder as `tar -C FOLDER -cf model.tar .` (or `casp models upload FOLDER`)"


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
        created_at=jobs.aware(row.created_at),  # type: ignore[arg-type]
        expires_at=jobs.aware(row.expires_at),  # type: ignore[arg-type]
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
    file: Annotated[UploadFile, File(description="the model's folder as a tar archive (optionally gzip-compressed)")],
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
    storage: StorageDep,
    name: Annotated[
        str | None,
        Form(
            pattern=MODEL_NAME_PATTERN,
            description="the model's name (its pruned model card's); default: the archive's top folder, or `model`",
        ),
    ] = None,
    retention_seconds: Annotated[
        int | None,
        Form(gt=0, description="how long it is kept; default CASP_ARTIFACT_RETENTION_SECONDS, at most the maximum"),
    ] = None,
) -> ModelOut:
    """Checked before it is kept: a config of a supported family, a tokenizer, and safetensors weights whose
    tensors and shapes are the config's (read from the files' headers). Otherwise 422 on `file`, saying why."""
    retention = retention_of(retention_seconds, settings)
    row = accept_archive(file.file, name, retention, new_id(), session, caller, settings, storage)
    session.commit()
    return model_out(row)


def accept_archive(
    archive: BinaryIO,
    name: str | None,
    retention: int,
    model_id: str,
    session: Session,
    caller: jobs.Caller,
    settings: Settings,
    storage: Storage,
) -> UploadedModel:
    """The archive checked, stored as the model `model_id` and recorded (uncommitted); 422 on `file` or `name`."""
    with tempfile.TemporaryDirectory(dir=scratch_of(settings)) as unpacked:
        folder = unpack(archive, Path(unpacked), settings.max_upload_bytes)
        chosen = name or (folder.name if folder != Path(unpacked) else "model")
        if not re.match(MODEL_NAME_PATTERN, chosen):
            raise invalid(("name",), f"the archive's folder {chosen[:100]!r} is no model name: give `name`")
        try:
            config = check_model_folder(folder)
        except CaspError as exc:
            # casp_core names the folder it read: the server's scratch path is not the caller's to see.
            raise invalid(ARCHIVE, f"{exc.code}: {exc.message.replace(str(folder), chosen)}") from exc
        files = files_of(folder)
        size = sum(path.stat().st_size for _, path in files)
        storage.put_model(model_id, chosen, folder)
    return jobs.add_owned(
        session,
        caller,
        UploadedModel,
        id=model_id,
        name=chosen,
        model_type=config.model_type,
        size=size,
        files=len(files),
        expires_at=utcnow() + timedelta(seconds=retention),
    )


def finish_pending(session: Session, bucket: S3Storage, upload_id: str) -> None:
    """The pending upload done with, accepted or refused: its tar and its row go."""
    bucket.delete_pending_upload(upload_id)
    jobs.forget_pending_upload(session, upload_id)
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
    """A URL to PUT the model's tar to, straight into the artifact bucket, then `POST /v1/models/{id}/complete`,
    which checks it as `POST /v1/models` checks a multipart upload. The URL expires after CASP_URL_TTL_SECONDS; a
    tar not completed within a day after that is deleted. S3 storage only (400 otherwise)."""
    bucket = s3_storage(storage)
    retention = retention_of(body.retention_seconds, settings)
    now = utcnow()
    row = jobs.add_owned(
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
    """Checks the tar PUT to the presigned URL as a multipart upload is checked; 201 with the model (the upload's
    id), or 422 on `file` with the reason. Either way the upload is done with: a refused tar is deleted, and a new
    presigned upload starts again. 409 while nothing was PUT; 404 for an unknown, expired or another key's id."""
    bucket = s3_storage(storage)
    pending = jobs.get_pending_upload(session, caller, upload_id)
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
            row = accept_archive(
                archive, pending.name, pending.retention_seconds, pending.id, session, caller, settings, storage
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
    rows, has_more = jobs.list_uploaded_models(session, caller, limit=limit, after=after)
    return ModelList(data=[model_out(row) for row in rows], has_more=has_more)


@router.delete("/{model_id}", status_code=status.HTTP_204_NO_CONTENT, responses=responses(404))
def delete_model(model_id: ModelId, session: SessionDep, caller: CallerDep, storage: StorageDep) -> Response:
    """Deletes the model now; a queued job that names it fails with `model_not_found` when it starts."""
    row = jobs.get_uploaded_model(session, caller, model_id)
    if row is None:  # another key's answers exactly like a missing one
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no uploaded model {model_id}")
    storage.delete_model(row.id)
    jobs.forget_upload(session, row.id)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
