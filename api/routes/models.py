"""/v1/models: models a key uploads (a tar of the model's folder), for its jobs to prune as `casp://models/<id>`."""

import re
import tarfile
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Annotated, BinaryIO

from fastapi import APIRouter, File, Form, HTTPException, Query, Response, UploadFile, status

from api.deps import CallerDep, SessionDep, SettingsDep, StorageDep
from api.errors import responses
from api.routes.jobs import invalid, retention_of
from api.schemas import MODEL_NAME_PATTERN, JobIdText, ModelId, ModelList, ModelOut
from casp_core.errors import CaspError
from casp_core.model import check_model_folder
from service import jobs
from service.paths import UPLOAD_SCHEME
from service.storage import files_of
from service.tables import UploadedModel, new_id, utcnow

router = APIRouter(prefix="/v1/models", tags=["models"], responses=responses(401, 422))

ARCHIVE = ("file",)
# A model folder has a config, weights, a tokenizer: a few dozen files even sharded.
MAX_FILES = 1000
PACKING_HINT = "pack the model's folder as `tar -C FOLDER -cf model.tar .` (or `casp models upload FOLDER`)"


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


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ModelOut, responses=responses(413))
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
    scratch = settings.home / "uploads"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as unpacked:
        folder = unpack(file.file, Path(unpacked), settings.max_upload_bytes)
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
        model_id = new_id()
        storage.put_model(model_id, chosen, folder)
    row = jobs.add_uploaded_model(
        session,
        caller,
        id=model_id,
        name=chosen,
        model_type=config.model_type,
        size=size,
        files=len(files),
        expires_at=utcnow() + timedelta(seconds=retention),
    )
    session.commit()
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
