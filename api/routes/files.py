"""Downloads of artifacts on local storage, through URLs the API signed (S3 storage presigns its own)."""

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.responses import FileResponse

from api.deps import SessionDep, SettingsDep, StorageDep
from api.errors import artifacts_expired, responses
from api.schemas import JobId
from service.security import verify_download
from service.storage import LocalStorage
from service.tables import Artifact, Job, aware

router = APIRouter(prefix="/v1/files", tags=["files"], responses=responses(403, 404, 410, 422))


@router.get("/{job_id}/{name:path}", response_class=FileResponse)
def download(
    job_id: JobId,
    name: str,
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    expires: Annotated[int, Query()],
    signature: Annotated[str, Query()],
) -> FileResponse:
    # The signature is the credential here, as with a presigned S3 URL: no Authorization header needed.
    if not verify_download(settings.verification_keys, job_id, name, expires, signature):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "the link is invalid or has expired")
    job = session.get(Job, job_id)
    if job is not None and job.artifacts_deleted:
        raise artifacts_expired(aware(job.expires_at))
    if not isinstance(storage, LocalStorage) or session.get(Artifact, (job_id, name)) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no such artifact")
    return FileResponse(storage.path(job_id, name), filename=name.rsplit("/", 1)[-1])
