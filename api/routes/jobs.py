"""/v1/jobs: submit, inspect, page, cancel, list and delete artifacts."""

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated

from botocore.exceptions import BotoCoreError
from fastapi import APIRouter, Body, Header, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from sse_starlette import EventSourceResponse

from api.deps import CallerDep, DispatcherDep, SessionDep, SettingsDep, StorageDep
from api.errors import ApiError, artifacts_expired, responses
from api.json_body import JsonRoute
from api.schemas import (
    JOB_EXAMPLES,
    MAX_EVENT_ID,
    ArtifactList,
    ArtifactOut,
    EventList,
    EventOut,
    JobCreate,
    JobError,
    JobId,
    JobIdText,
    JobList,
    JobOut,
)
from api.streams import StreamResponse, StreamSlots, event_stream
from api.unavailable import RETRY_AFTER_SECONDS
from casp_core.artifacts.gguf.source import is_gguf_reference
from casp_core.data import TextSource, calibration_source, evaluation_source
from casp_core.errors import CaspError, InvalidConfig, InvalidDataset, UnsupportedExport
from casp_core.job.plan import plan_job
from casp_core.model import is_local_reference, key_digest, load_config
from casp_core.settings import SERVER_SIDE, PruneConfig
from service import api_keys, jobs, uploaded_models, webhook_deliveries
from service.db import session_scope
from service.dispatch import queue_for, send
from service.logs import add_log_context
from service.model_sources import bucket_location, check_gguf_object
from service.paths import (
    S3_SCHEME,
    UPLOAD_SCHEME,
    InputRefused,
    Loc,
    check_dataset,
    check_model,
    check_training_data,
    excerpt,
    is_remote_model,
    upload_id_of,
)
from service.settings import Settings
from service.tables import JOB_STATUSES, Job, JobEvent, aware, utcnow
from service.webhooks import WebhookRefused, check_webhook_url

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=responses(401, 422), route_class=JsonRoute)


def invalid(loc: Loc, message: str) -> RequestValidationError:
    """A 422 like the schema's own, so checks made here read the same (the input is not echoed)."""
    return RequestValidationError([{"type": "value_error", "loc": ("body", *loc), "msg": message}])


def resolve_model(body: JobCreate, settings: Settings, session: SessionDep, caller: api_keys.Caller) -> str:
    if (is_local_reference(body.model) or is_remote_model(body.model)) and body.revision is not None:
        raise invalid(("revision",), "only a Hugging Face id takes a revision")
    try:
        model = check_model(body.model, settings)
        if (
            model.startswith(UPLOAD_SCHEME)
            and uploaded_models.get_uploaded_model(session, caller, upload_id_of(model)) is None
        ):
            # Another key's upload answers exactly like a missing one.
            raise InputRefused(("model",), f"no uploaded model {excerpt(model)} for this key (see GET /v1/models)")
    except InputRefused as exc:
        raise invalid(exc.loc, exc.message) from exc
    if model.startswith(S3_SCHEME) and is_gguf_reference(model):
        try:  # its first bytes only: the worker checks the whole header once it has downloaded the file
            check_gguf_object(bucket_location(model, settings))
        except CaspError as exc:
            raise invalid(("model",), f"{exc.code}: {exc.message}") from exc
        except BotoCoreError as exc:  # the bucket's S3 server did not answer: no fault of the request's
            raise ApiError(
                status.HTTP_503_SERVICE_UNAVAILABLE,
                f"the S3 server of {excerpt(model)} could not be reached ({type(exc).__name__}); retry later",
                "s3_unreachable",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from exc
    elif is_local_reference(model):  # a GGUF file in a bucket is no local one, though its name says .gguf
        try:
            # An unsupported family is refused now (load_config), not after the worker loads it. With a ratio or
            # a target, what the job would refuse from the model's config (casp_core.job.plan) is refused too, with
            # the job's message: an export the family cannot take (unsupported_export, under `export`), settings
            # it is not pruned with, a ratio it cannot reach, a quantization its widths cannot take, recovery
            # windows longer than its context, a budget no candidate meets (a hub model's, when the job starts).
            # `model` alone (POST /v1/models/check from the console's model field) checks the model by itself.
            model_config = load_config(model)
            if body.ratio is not None or body.target is not None:
                plan_job(PruneConfig.from_dict(body.settings()), model_config)
        except (InvalidConfig, InvalidDataset) as exc:  # both name the setting first
            field, _, reason = exc.message.partition(": ")
            raise invalid(tuple(field.split(".")), reason or exc.message) from exc
        except UnsupportedExport as exc:
            raise invalid(("export",), f"{exc.code}: {exc.message}") from exc
        except CaspError as exc:
            raise invalid(("model",), f"{exc.code}: {exc.message}") from exc
    return model


def resolve_dataset(spec: str, loc: Loc, settings: Settings, source_of: Callable[[str], TextSource]) -> str:
    try:
        return check_dataset(spec, loc, settings, source_of)
    except InputRefused as exc:
        raise invalid(exc.loc, exc.message) from exc


def check_webhook(body: JobCreate, settings: Settings) -> str | None:
    if body.webhook_url is None:
        if body.webhook_events is not None:
            raise invalid(("webhook_events",), "only goes with a `webhook_url`")
        return None
    if not settings.webhook_secret:
        raise invalid(("webhook_url",), "webhooks are off on this server (no CASP_WEBHOOK_SECRET)")
    try:
        check_webhook_url(body.webhook_url, settings)
    except WebhookRefused as exc:
        raise invalid(("webhook_url",), str(exc)) from exc
    return body.webhook_url


def build_config(body: JobCreate, settings: Settings) -> PruneConfig:
    """The request's settings with its data sets checked against the server's rules, and the server's own."""
    chosen = body.settings()
    calibration, evaluation = chosen["calibration"], chosen["evaluation"]
    calibration["dataset"] = resolve_dataset(
        calibration["dataset"], ("calibration", "dataset"), settings, calibration_source
    )
    evaluation["perplexity"] = [
        resolve_dataset(spec, ("evaluation", "perplexity", i), settings, evaluation_source)
        for i, spec in enumerate(evaluation["perplexity"])
    ]
    if chosen["recovery"]["method"] != "none":
        try:
            chosen["recovery"]["dataset"] = check_training_data(chosen["recovery"]["dataset"], settings)
        except InputRefused as exc:
            # Bad records say so with the job's error code (invalid_dataset), as a worker's check would.
            message = f"{exc.code}: {exc.message}" if exc.code == InvalidDataset.code else exc.message
            raise invalid(exc.loc, message) from exc
    try:
        return PruneConfig.from_dict(
            {**chosen, "datasets_dir": str(settings.datasets_dir) if settings.datasets_dir else None}
        ).validate()
    except InvalidConfig as exc:
        # casp_core reports "field.sub: reason": keep the 422 pointing at that field.
        field, _, reason = exc.message.partition(": ")
        raise invalid(tuple(field.split(".")), reason or exc.message) from exc


def job_out(job: Job) -> JobOut:
    return JobOut(
        id=job.id,
        status=job.status,
        stage=job.stage,
        progress=round(job.progress, 1),
        model=job.model,
        revision=job.revision,
        device=job.device,
        settings={k: v for k, v in job.config.items() if k not in SERVER_SIDE},
        metadata=job.metadata_,
        cancel_requested=job.cancel_requested,
        attempts=job.attempts,
        error=JobError(code=job.error_code, message=job.error_message or "") if job.error_code else None,
        result=job.result,
        created_at=aware(job.created_at),
        started_at=aware(job.started_at),
        finished_at=aware(job.finished_at),
        expires_at=aware(job.expires_at),
        webhook_url=job.webhook_url,
        webhook_events=(job.webhook_events or list(webhook_deliveries.FINAL_EVENTS)) if job.webhook_url else None,
        webhook_state=job.webhook_state,  # type: ignore[arg-type]
    )


def retention_of(requested: int | None, settings: Settings) -> int:
    """How long artifacts (or an uploaded model) are kept: what the request asks, within the server's maximum."""
    if requested is None:
        return settings.artifact_retention_seconds
    if requested > settings.max_artifact_retention_seconds:
        raise invalid(
            ("retention_seconds",),
            f"at most {settings.max_artifact_retention_seconds} s on this server (CASP_MAX_ARTIFACT_RETENTION_SECONDS)",
        )
    return requested


def visible_job(session: SessionDep, caller: CallerDep, job_id: str) -> Job:
    # Another key's job answers exactly like a missing one: ids are not to be probed.
    job = jobs.get_job(session, caller, job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    return job


@router.post(
    "", status_code=status.HTTP_201_CREATED, response_model=JobOut, responses=responses(400, 409, 413, 429, 503)
)
def create_job(
    body: Annotated[JobCreate, Body(openapi_examples=JOB_EXAMPLES)],
    request: Request,
    response: Response,
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
    dispatcher: DispatcherDep,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JobOut:
    device = body.device or settings.default_device
    devices: tuple[str, ...] | None = request.app.state.devices
    if devices is not None and device not in devices:
        why = "asks for" if body.device else f"has no device and CASP_DEFAULT_DEVICE is {device}, but needs"
        raise invalid(("device",), f"the job {why} {device}; this server runs jobs on {', '.join(devices)}")
    dispatched_at = utcnow()
    fields = {
        "model": resolve_model(body, settings, session, caller),
        "revision": body.revision,
        "device": device,
        "queue": queue_for(device),
        "config": build_config(body, settings).to_dict(),
        "metadata_": body.metadata,
        "dispatched_at": dispatched_at,
        "retention_seconds": retention_of(body.retention_seconds, settings),
    }
    webhook_url = check_webhook(body, settings)
    if webhook_url:
        fields |= {"webhook_url": webhook_url, "webhook_events": body.webhook_events, "webhook_state": "pending"}
    request_hash = key_digest(body.model_dump(mode="json"))
    limits = api_keys.limits_of(session, caller, settings)
    try:
        job, created = jobs.create_job(session, caller, fields, idempotency_key, request_hash, limits)
    except jobs.IdempotencyConflict as exc:
        raise HTTPException(
            status.HTTP_409_CONFLICT, "this Idempotency-Key was used with a different request body"
        ) from exc
    except api_keys.LimitExceeded as exc:
        raise ApiError(
            status.HTTP_429_TOO_MANY_REQUESTS,
            exc.message,
            f"{exc.limit}_exceeded",
            headers={"Retry-After": str(exc.retry_after)},
        ) from exc
    session.commit()
    add_log_context(job_id=job.id)
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
        return job_out(job)
    # The row is committed first: if the broker is down, the job stays queued, unsent, and the reaper sends it
    # once the broker is back.
    send(settings, dispatcher, job.id, job.queue, dispatched_at, failure_event=True)
    return job_out(job)


@router.get("", response_model=JobList)
def list_jobs(
    session: SessionDep,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[JobIdText | None, Query(description="id of the last job of the previous page")] = None,
    status_: Annotated[str | None, Query(alias="status", pattern=f"^({'|'.join(JOB_STATUSES)})$")] = None,
) -> JobList:
    rows, has_more = jobs.list_jobs(session, caller, status=status_, limit=limit, after=after)
    return JobList(data=[job_out(job) for job in rows], has_more=has_more)


@router.get("/{job_id}", response_model=JobOut, responses=responses(404))
def get_job(job_id: JobId, session: SessionDep, caller: CallerDep) -> JobOut:
    return job_out(visible_job(session, caller, job_id))


def event_out(event: JobEvent) -> EventOut:
    return EventOut(
        id=event.id,
        attempt=event.attempt,
        kind=event.kind,
        status=event.status,
        stage=event.stage,
        progress=round(event.progress, 1),
        message=event.message,
        created_at=aware(event.created_at),
    )


def events_since(settings: Settings, job_id: str, after: int | None) -> tuple[list[EventOut], bool]:
    """The job's next events, and whether it had finished before they were read (so none is missed after)."""
    with session_scope(settings.database) as session:
        done = jobs.is_finished(session.get_one(Job, job_id))
        rows, _ = jobs.list_events(session, job_id, limit=100, after=after)
        return [event_out(e) for e in rows], done


def last_event_id(header: str | None) -> int | None:
    """The id a reconnecting EventSource sends. One that is not an event id (absent, `null`, out of range) starts
    the stream from the beginning, as the SSE specification has a client do with an id it cannot use."""
    text = (header or "").strip()
    if not (text.isascii() and text.isdigit()):  # `²` is a digit to str.isdigit, and no number to int
        return None
    value = int(text)
    return value if value <= MAX_EVENT_ID else None


STREAM_DESCRIPTION = (
    "With `stream=true`: Server-Sent Events (`text/event-stream`), one per job event (`id`: the event id,"
    " `event`: its kind, `data`: the event as JSON, an EventOut), from `after` or the `Last-Event-ID` header, and a"
    " `: ping` comment every 15 s; the stream ends once the job has finished. A key holds at most"
    " CASP_MAX_STREAMS_PER_KEY streams at once: past that, 429 with Retry-After, and the client polls instead."
)
# The SSE body as OpenAPI 3.1 describes a stream of events: text, whose items are the events.
EVENT_STREAM_CONTENT = {
    "text/event-stream": {
        "schema": {"type": "string", "contentMediaType": "text/event-stream"},
        "itemSchema": {
            "type": "object",
            "required": ["id", "event", "data"],
            "properties": {
                "id": {"type": "string", "description": "the event's id"},
                "event": {"type": "string", "description": "its kind: status, progress, warning or webhook"},
                "data": {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": {"$ref": "#/components/schemas/EventOut"},
                },
            },
        },
    }
}


@router.get(
    "/{job_id}/events",
    response_model=EventList,
    responses={
        **responses(404, 429),
        200: {"description": STREAM_DESCRIPTION, "content": EVENT_STREAM_CONTENT},
    },
)
def list_events(
    job_id: JobId,
    request: Request,
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 100,
    after: Annotated[
        int | None, Query(ge=0, le=MAX_EVENT_ID, description="id of the last event of the previous page")
    ] = None,
    stream: Annotated[bool, Query(description="follow the events as Server-Sent Events")] = False,
    last_event_id_header: Annotated[
        str | None,
        Header(
            alias="Last-Event-ID",
            max_length=64,
            description="with `stream=true`: the id of the last event seen, as a reconnecting EventSource sends"
            " it; one that is not an event id starts from the beginning",
        ),
    ] = None,
) -> EventList | EventSourceResponse:
    visible_job(session, caller, job_id)
    if stream:
        # The session is not held for the stream's life: each read opens its own, after a notification.
        session.close()
        slots: StreamSlots = request.app.state.stream_slots
        slots.take(caller.key_id)
        start = last_event_id(last_event_id_header)
        events = event_stream(
            request.app.state.watches,
            job_id,
            after if start is None else start,
            lambda job, since: events_since(settings, job, since),
        )
        return StreamResponse(events, on_close=lambda: slots.give_back(caller.key_id))
    rows, has_more = jobs.list_events(session, job_id, limit=limit, after=after)
    return EventList(data=[event_out(e) for e in rows], has_more=has_more)


@router.post("/{job_id}/cancel", response_model=JobOut, responses=responses(404, 409))
def cancel_job(job_id: JobId, session: SessionDep, caller: CallerDep) -> JobOut:
    job = visible_job(session, caller, job_id)
    if not jobs.request_cancel(session, job):
        raise HTTPException(status.HTTP_409_CONFLICT, f"the job has already {job.status}")
    session.commit()
    return job_out(job)


@router.get("/{job_id}/artifacts", response_model=ArtifactList, responses=responses(404, 409, 410))
def list_artifacts(
    job_id: JobId,
    request: Request,
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
    storage: StorageDep,
) -> ArtifactList:
    job = visible_job(session, caller, job_id)
    if job.artifacts_deleted:
        raise artifacts_expired(aware(job.expires_at))
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
        for a in jobs.artifacts_of(session, job.id)
    ]
    return ArtifactList(data=data)


@router.delete("/{job_id}", status_code=status.HTTP_204_NO_CONTENT, responses=responses(404, 409))
def delete_job_artifacts(job_id: JobId, session: SessionDep, caller: CallerDep, storage: StorageDep) -> Response:
    job = visible_job(session, caller, job_id)
    if not jobs.is_finished(job):
        raise HTTPException(status.HTTP_409_CONFLICT, f"the job is {job.status}; cancel it first")
    storage.delete(job.id)
    jobs.forget_artifacts(session, job)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
