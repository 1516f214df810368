"""/v1/jobs: submit, inspect, page, cancel, list and delete artifacts."""

import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError

from api import crud
from api.core.settings import Settings
from api.deps import CallerDep, DispatcherDep, SessionDep, SettingsDep, StorageDep
from api.models import JOB_STATUSES, Job
from api.schemas import (
    ArtifactList,
    ArtifactOut,
    EventList,
    EventOut,
    JobCreate,
    JobError,
    JobList,
    JobOut,
    is_local_path,
)
from casp_core.config import CalibrationConfig, EvaluationConfig, PruneConfig
from casp_core.data import LOCAL_FILES as NAMED_DATASETS
from casp_core.errors import InvalidConfig

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

DATASET_FILE_SUFFIXES = (".txt", ".jsonl")
# Settings the service decides, not the caller: shown elsewhere on the job or private to the server.
HIDDEN_SETTINGS = ("datasets_dir", "device")


def invalid(loc: tuple[str | int, ...], message: str, value: Any) -> RequestValidationError:
    """A 422 in FastAPI's own shape, so checks made here read like the schema's."""
    return RequestValidationError([{"type": "value_error", "loc": ("body", *loc), "msg": message, "input": value}])


def _under_roots(path: Path, roots: list[Path]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def resolve_model(body: JobCreate, settings: Settings) -> str:
    if not is_local_path(body.model):
        return body.model
    if body.revision is not None:
        raise invalid(("revision",), "only a Hugging Face id takes a revision", body.revision)
    # Resolved first, so `..` and symbolic links cannot lead outside the allowed roots.
    path = Path(body.model).expanduser().resolve()
    roots = settings.model_roots()
    if not _under_roots(path, roots):
        allowed = ":".join(map(str, roots)) or "none configured"
        raise invalid(("model",), f"local models must lie under CASP_ALLOWED_MODEL_ROOTS ({allowed})", body.model)
    if not path.is_dir():
        raise invalid(("model",), "no such model folder", body.model)
    return str(path)


def resolve_dataset(spec: str, loc: tuple[str | int, ...], settings: Settings) -> str:
    """A named set (`name[:split]`, as casp_core knows them) or a file under the allowed roots: anything else
    casp_core would read as a path relative to the worker's directory."""
    name, colon, split = spec.partition(":")
    if name in NAMED_DATASETS:
        if colon and split not in NAMED_DATASETS[name]:
            raise invalid(loc, f"{name} has no split {split!r} (known: {', '.join(NAMED_DATASETS[name])})", spec)
        return spec
    path = Path(spec).expanduser().resolve()
    roots = settings.model_roots() + ([settings.datasets_dir.resolve()] if settings.datasets_dir else [])
    if path.suffix not in DATASET_FILE_SUFFIXES:
        known = ", ".join(NAMED_DATASETS)
        raise invalid(loc, f"must be one of {known} (optionally `:split`) or a .txt or .jsonl file", spec)
    if not _under_roots(path, roots) or not path.is_file():
        raise invalid(loc, "data set files must exist under CASP_ALLOWED_MODEL_ROOTS or CASP_DATASETS_DIR", spec)
    return str(path)


def build_config(body: JobCreate, settings: Settings) -> PruneConfig:
    calibration = body.calibration.model_dump()
    calibration["dataset"] = resolve_dataset(calibration["dataset"], ("calibration", "dataset"), settings)
    evaluation = body.evaluation.model_dump()
    evaluation["perplexity"] = [
        resolve_dataset(spec, ("evaluation", "perplexity", i), settings)
        for i, spec in enumerate(evaluation["perplexity"])
    ]
    config = PruneConfig(
        ratio=body.ratio,
        alpha=body.alpha,
        solver=body.solver,
        allocation=body.allocation,
        calibration=CalibrationConfig(**calibration),
        evaluation=EvaluationConfig(**evaluation),
        datasets_dir=str(settings.datasets_dir) if settings.datasets_dir else None,
    )
    try:
        return config.validate()
    except InvalidConfig as exc:
        # casp_core reports "field.sub: reason": keep the 422 pointing at that field.
        field, _, reason = exc.message.partition(": ")
        raise invalid(tuple(field.split(".")), reason or exc.message, None) from exc


def job_out(job: Job) -> JobOut:
    return JobOut(
        id=job.id,
        status=job.status,
        stage=job.stage,
        progress=round(job.progress, 1),
        model=job.model,
        revision=job.revision,
        device=job.device,
        settings={k: v for k, v in job.config.items() if k not in HIDDEN_SETTINGS},
        metadata=job.metadata_,
        cancel_requested=job.cancel_requested,
        attempts=job.attempts,
        error=JobError(code=job.error_code, message=job.error_message or "") if job.error_code else None,
        result=job.result,
        created_at=crud.aware(job.created_at),
        started_at=crud.aware(job.started_at),
        finished_at=crud.aware(job.finished_at),
    )


def visible_job(session: SessionDep, caller: CallerDep, job_id: str) -> Job:
    # Another key's job answers exactly like a missing one: ids are not to be probed.
    job = crud.get_job(session, caller, job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    return job


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobOut)
def create_job(
    body: JobCreate,
    response: Response,
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
    dispatcher: DispatcherDep,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JobOut:
    device = body.device or settings.default_device
    fields = {
        "model": resolve_model(body, settings),
        "revision": body.revision,
        "device": device,
        "queue": settings.queue_for(device),
        "config": build_config(body, settings).to_dict(),
        "metadata_": body.metadata,
    }
    request_hash = hashlib.sha256(json.dumps(body.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    try:
        job, created = crud.create_job(session, caller, fields, idempotency_key, request_hash)
    except crud.IdempotencyConflict as exc:
        raise HTTPException(
            status.HTTP_409_CONFLICT, "this Idempotency-Key was used with a different request body"
        ) from exc
    session.commit()
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
        return job_out(job)
    try:
        dispatcher.enqueue(job.id, job.queue)
    except Exception as exc:
        # Without a message no worker would ever see the job: end it now rather than leave it queued.
        crud.finish_unqueued(session, job, ("broker_unavailable", f"could not queue the job: {exc}"))
        session.commit()
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the job queue is unreachable") from exc
    return job_out(job)


@router.get("", response_model=JobList)
def list_jobs(
    session: SessionDep,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(description="id of the last job of the previous page")] = None,
    status_: Annotated[str | None, Query(alias="status", pattern=f"^({'|'.join(JOB_STATUSES)})$")] = None,
) -> JobList:
    rows, has_more = crud.list_jobs(session, caller, status=status_, limit=limit, after=after)
    return JobList(data=[job_out(job) for job in rows], has_more=has_more)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job_id: str, session: SessionDep, caller: CallerDep) -> JobOut:
    return job_out(visible_job(session, caller, job_id))


@router.get("/{job_id}/events", response_model=EventList)
def list_events(
    job_id: str,
    session: SessionDep,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 100,
    after: Annotated[int | None, Query(description="id of the last event of the previous page")] = None,
) -> EventList:
    visible_job(session, caller, job_id)
    rows, has_more = crud.list_events(session, job_id, limit=limit, after=after)
    data = [
        EventOut(
            id=e.id,
            attempt=e.attempt,
            kind=e.kind,
            status=e.status,
            stage=e.stage,
            progress=round(e.progress, 1),
            message=e.message,
            created_at=crud.aware(e.created_at),
        )
        for e in rows
    ]
    return EventList(data=data, has_more=has_more)


@router.post("/{job_id}/cancel", response_model=JobOut)
def cancel_job(job_id: str, session: SessionDep, caller: CallerDep) -> JobOut:
    job = visible_job(session, caller, job_id)
    if not crud.request_cancel(session, job):
        raise HTTPException(status.HTTP_409_CONFLICT, f"the job has already {job.status}")
    session.commit()
    return job_out(job)


@router.get("/{job_id}/artifacts", response_model=ArtifactList)
def list_artifacts(
    job_id: str,
    request: Request,
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
    storage: StorageDep,
) -> ArtifactList:
    job = visible_job(session, caller, job_id)
    if job.artifacts_deleted:
        raise HTTPException(status.HTTP_410_GONE, "the job's artifacts were deleted")
    if job.status != "succeeded":
        raise HTTPException(status.HTTP_409_CONFLICT, f"the job is {job.status}; artifacts come with success")
    base_url = settings.public_url or str(request.base_url)
    ttl = settings.url_ttl_seconds
    expires_at = datetime.now(UTC) + timedelta(seconds=ttl)
    data = [
        ArtifactOut(
            name=a.name,
            size=a.size,
            sha256=a.sha256,
            url=storage.url(job.id, a.name, ttl, base_url),
            expires_at=expires_at,
        )
        for a in crud.artifacts_of(session, job.id)
    ]
    return ArtifactList(data=data)


@router.delete("/{job_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_job_artifacts(job_id: str, session: SessionDep, caller: CallerDep, storage: StorageDep) -> Response:
    job = visible_job(session, caller, job_id)
    if not crud.is_finished(job):
        raise HTTPException(status.HTTP_409_CONFLICT, f"the job is {job.status}; cancel it first")
    storage.delete(job.id)
    crud.forget_artifacts(session, job)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
