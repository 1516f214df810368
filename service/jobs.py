"""Reads and writes of the database, kept apart from the HTTP routes and the worker so both share them.

State changes of a job are conditional UPDATEs (`... WHERE status = 'queued'`, `... AND attempts = n`): two
workers, the reaper and a cancel request can race, and the row must end in exactly one consistent state.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.events import note_event
from service.metrics import WEBHOOK_EVENT_KIND, WEBHOOK_FAILURE_PREFIX
from service.security import hash_api_key, new_api_key
from service.settings import Settings
from service.storage import StoredFile
from service.tables import (
    FINISHED_STATUSES,
    ApiKey,
    Artifact,
    Job,
    JobEvent,
    PendingUpload,
    StageDelivery,
    StageTiming,
    UploadedModel,
    new_id,
    utcnow,
)

ACTIVE_STATUSES = ("queued", "running")
# Submissions per minute are counted over the last 60 s (a sliding window, from the jobs' own rows).
SUBMISSION_WINDOW = timedelta(seconds=60)
# When one of its jobs ends is unknown: a key at its active-jobs limit is asked to come back after this.
ACTIVE_RETRY_AFTER_SECONDS = 30


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


# --- API keys -------------------------------------------------------------------------------------------


def create_api_key(
    session: Session, name: str, *, max_active_jobs: int | None = None, max_submissions_per_minute: int | None = None
) -> tuple[ApiKey, str]:
    """Returns the row and the key itself, which is shown once and never stored. Limits left None are the
    server's."""
    raw = new_api_key()
    row = ApiKey(
        id=new_id(),
        name=name,
        key_hash=hash_api_key(raw),
        max_active_jobs=max_active_jobs,
        max_submissions_per_minute=max_submissions_per_minute,
    )
    session.add(row)
    session.flush()
    return row, raw


def find_api_key(session: Session, raw: str) -> ApiKey | None:
    return session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_api_key(raw)))


# A revoked key's row stays (its name, its jobs and their artifacts): only its hash is replaced by this marker
# and the row's id, which no SHA-256 hex digest can equal.
REVOKED_MARK = "revoked:"


def revoke_api_key(session: Session, key_id: str) -> ApiKey | None:
    """The key stops working at once; None when there is no such key. Revoking twice changes nothing."""
    row = session.get(ApiKey, key_id)
    if row is not None:
        row.key_hash = REVOKED_MARK + row.id
        session.flush()
    return row


def set_hub_token(session: Session, key_id: str, encrypted: str | None) -> ApiKey | None:
    """Stores the key's encrypted hub token (None removes it); None when there is no such key."""
    row = session.get(ApiKey, key_id)
    if row is not None:
        row.hub_token = encrypted
        session.flush()
    return row


def list_api_keys(session: Session) -> Sequence[ApiKey]:
    return session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)).all()


def is_revoked(key: ApiKey) -> bool:
    return key.key_hash.startswith(REVOKED_MARK)


# --- jobs as the API sees them ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """Who asks. `key_id` None means auth is off and every job is visible."""

    key_id: str | None


def _visible(caller: Caller) -> Any:
    return True if caller.key_id is None else Job.owner_id == caller.key_id


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different request body."""


# --- fair use -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    max_active_jobs: int
    max_submissions_per_minute: int


def limits_of(session: Session, caller: Caller, settings: Settings) -> Limits | None:
    """The caller's limits: its key's own where set, else the server's; None without keys (auth off)."""
    key = session.get(ApiKey, caller.key_id) if caller.key_id else None
    if key is None:
        return None
    return Limits(
        max_active_jobs=key.max_active_jobs or settings.max_active_jobs,
        max_submissions_per_minute=key.max_submissions_per_minute or settings.max_submissions_per_minute,
    )


class LimitExceeded(Exception):
    """A submission over one of the key's limits; `limit` is its name, `retry_after` whole seconds."""

    def __init__(self, limit: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.message = message
        self.retry_after = retry_after


def active_jobs(session: Session, caller: Caller) -> int:
    query = select(func.count()).select_from(Job).where(_visible(caller), Job.status.in_(ACTIVE_STATUSES))
    return session.scalar(query) or 0


def recent_submissions(session: Session, caller: Caller, now: datetime) -> list[datetime]:
    """Creation times of the caller's jobs in the last minute, oldest first."""
    query = select(Job.created_at).where(_visible(caller), Job.created_at > now - SUBMISSION_WINDOW)
    return [aware(t) for t in session.scalars(query.order_by(Job.created_at))]  # type: ignore[misc]


def serialise_submissions(session: Session, caller: Caller) -> None:
    """Holds the caller's other submissions back until this transaction ends, so that two at once cannot both
    count the same free place. PostgreSQL: the key's row is locked. SQLite has no row locks, and its driver
    begins a transaction only at the first write, so the counts would be read outside it: the transaction
    begins here as a writer (BEGIN IMMEDIATE), which waits for any other writer and keeps the next one waiting."""
    connection = session.connection()
    if connection.dialect.name == "sqlite":
        if not connection.connection.driver_connection.in_transaction:  # type: ignore[union-attr]
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        return
    session.execute(select(ApiKey.id).where(ApiKey.id == caller.key_id).with_for_update())


def check_limits(session: Session, caller: Caller, limits: Limits) -> None:
    """Raises LimitExceeded when one more job would take the caller past a limit."""
    serialise_submissions(session, caller)
    active = active_jobs(session, caller)
    if active >= limits.max_active_jobs:
        raise LimitExceeded(
            "max_active_jobs",
            f"this key has {active} jobs queued or running, its limit max_active_jobs is {limits.max_active_jobs};"
            " submit again when one has finished",
            ACTIVE_RETRY_AFTER_SECONDS,
        )
    now = utcnow()
    recent = recent_submissions(session, caller, now)
    if len(recent) >= limits.max_submissions_per_minute:
        # The next place frees when the oldest submission that keeps the window full leaves it.
        frees_at = recent[len(recent) - limits.max_submissions_per_minute] + SUBMISSION_WINDOW
        raise LimitExceeded(
            "max_submissions_per_minute",
            f"this key submitted {len(recent)} jobs in the last minute, its limit max_submissions_per_minute is"
            f" {limits.max_submissions_per_minute}",
            max(1, math.ceil((frees_at - now).total_seconds())),
        )


@dataclass(frozen=True)
class Usage:
    active_jobs: int
    submissions_last_minute: int
    storage_bytes: int  # artifacts kept (not yet expired or deleted)
    artifact_files: int


def usage_of(session: Session, caller: Caller) -> Usage:
    stored = session.execute(
        select(func.coalesce(func.sum(Artifact.size), 0), func.count())
        .select_from(Artifact)
        .join(Job, Job.id == Artifact.job_id)
        .where(_visible(caller))
    ).one()
    return Usage(
        active_jobs=active_jobs(session, caller),
        submissions_last_minute=len(recent_submissions(session, caller, utcnow())),
        storage_bytes=int(stored[0]),
        artifact_files=int(stored[1]),
    )


def create_job(
    session: Session,
    caller: Caller,
    fields: dict[str, Any],
    idempotency_key: str | None,
    request_hash: str,
    limits: Limits | None = None,
) -> tuple[Job, bool]:
    """Inserts a queued job; returns (job, created). A repeated Idempotency-Key returns the first job, and
    is not held to the limits (the job exists already); a new one is, with `limits`."""
    scoped_key = f"{caller.key_id or '-'}:{idempotency_key}" if idempotency_key else None
    if scoped_key:
        existing = session.scalar(select(Job).where(Job.idempotency_key == scoped_key))
        if existing is not None:
            if existing.request_hash != request_hash:
                raise IdempotencyConflict
            return existing, False
    if limits is not None:
        check_limits(session, caller, limits)
    job = Job(
        id=new_id(),
        owner_id=caller.key_id,
        status="queued",
        progress=0.0,
        idempotency_key=scoped_key,
        request_hash=request_hash,
        **fields,
    )
    try:
        # A savepoint, so losing the race to a concurrent request with the same key leaves the session usable.
        with session.begin_nested():
            session.add(job)
            session.flush()
    except IntegrityError:
        if scoped_key is None:
            raise
        return create_job(session, caller, fields, idempotency_key, request_hash, limits)
    add_event(session, job, kind="status", message="queued")
    return job, True


def get_job(session: Session, caller: Caller, job_id: str) -> Job | None:
    return session.scalar(select(Job).where(Job.id == job_id, _visible(caller)))


def list_jobs(
    session: Session, caller: Caller, *, status: str | None, limit: int, after: str | None
) -> tuple[Sequence[Job], bool]:
    """Newest first; `after` is the id of the last job of the previous page."""
    query = select(Job).where(_visible(caller))
    if status:
        query = query.where(Job.status == status)
    if after:
        anchor = session.get(Job, after)
        if anchor is not None:
            query = query.where(
                or_(
                    Job.created_at < anchor.created_at,
                    and_(Job.created_at == anchor.created_at, Job.id < anchor.id),
                )
            )
    rows = session.scalars(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)).all()
    return rows[:limit], len(rows) > limit


def list_events(session: Session, job_id: str, *, limit: int, after: int | None) -> tuple[Sequence[JobEvent], bool]:
    query = select(JobEvent).where(JobEvent.job_id == job_id)
    if after is not None:
        query = query.where(JobEvent.id > after)
    rows = session.scalars(query.order_by(JobEvent.id).limit(limit + 1)).all()
    return rows[:limit], len(rows) > limit


def add_event(session: Session, job: Job, *, kind: str, message: str = "") -> None:
    """Writes an event; the job's event streams are woken once it is committed (service.events)."""
    note_event(session, job.id)
    session.add(
        JobEvent(
            job_id=job.id,
            attempt=job.attempts,
            kind=kind,
            status=job.status,
            stage=job.stage,
            progress=job.progress,
            message=message,
        )
    )


def request_cancel(session: Session, job: Job) -> bool:
    """A queued job is cancelled at once; a running one is flagged and its worker stops at the next layer
    boundary. Returns False when the job has already finished."""
    now = utcnow()
    cancelled = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == "queued")
        .values(status="cancelled", cancel_requested=True, finished_at=now)
    ).rowcount
    if not cancelled:
        flagged = session.execute(
            update(Job).where(Job.id == job.id, Job.status == "running").values(cancel_requested=True)
        ).rowcount
        if not flagged:
            return False
    session.refresh(job)
    add_event(session, job, kind="status", message="cancelled" if cancelled else "cancel requested")
    return True


def artifacts_of(session: Session, job_id: str) -> Sequence[Artifact]:
    return session.scalars(select(Artifact).where(Artifact.job_id == job_id).order_by(Artifact.name)).all()


def forget_artifacts(session: Session, job: Job) -> None:
    """A DELETE of the artifacts: they expire now."""
    session.execute(delete(Artifact).where(Artifact.job_id == job.id))
    job.artifacts_deleted = True
    job.expires_at = utcnow()


# --- uploaded models ------------------------------------------------------------------------------------


def _sees_upload(caller: Caller) -> Any:
    return True if caller.key_id is None else UploadedModel.owner_id == caller.key_id


OwnedRow = TypeVar("OwnedRow", UploadedModel, PendingUpload)


def add_owned(session: Session, caller: Caller, table: type[OwnedRow], **fields: Any) -> OwnedRow:
    """A new uploaded model or pending upload of the caller's key."""
    row = table(owner_id=caller.key_id, created_at=utcnow(), **fields)
    session.add(row)
    session.flush()
    return row


def get_uploaded_model(session: Session, caller: Caller, model_id: str) -> UploadedModel | None:
    return session.scalar(select(UploadedModel).where(UploadedModel.id == model_id, _sees_upload(caller)))


def list_uploaded_models(
    session: Session, caller: Caller, *, limit: int, after: str | None
) -> tuple[Sequence[UploadedModel], bool]:
    """Newest first; `after` is the id of the last model of the previous page."""
    query = select(UploadedModel).where(_sees_upload(caller))
    if after:
        anchor = session.get(UploadedModel, after)
        if anchor is not None:
            query = query.where(
                or_(
                    UploadedModel.created_at < anchor.created_at,
                    and_(UploadedModel.created_at == anchor.created_at, UploadedModel.id < anchor.id),
                )
            )
    order = (UploadedModel.created_at.desc(), UploadedModel.id.desc())
    rows = session.scalars(query.order_by(*order).limit(limit + 1)).all()
    return rows[:limit], len(rows) > limit


def expired_uploads(session: Session, now: datetime, limit: int = 100) -> Sequence[str]:
    query = select(UploadedModel.id).where(UploadedModel.expires_at <= now)
    return session.scalars(query.order_by(UploadedModel.expires_at).limit(limit)).all()


def forget_upload(session: Session, model_id: str) -> None:
    session.execute(delete(UploadedModel).where(UploadedModel.id == model_id))


def get_pending_upload(session: Session, caller: Caller, upload_id: str) -> PendingUpload | None:
    """The caller's pending upload, not yet expired; another key's answers as a missing one."""
    query = select(PendingUpload).where(PendingUpload.id == upload_id, PendingUpload.expires_at > utcnow())
    if caller.key_id is not None:
        query = query.where(PendingUpload.owner_id == caller.key_id)
    return session.scalar(query)


def expired_pending_uploads(session: Session, now: datetime, limit: int = 100) -> Sequence[str]:
    query = select(PendingUpload.id).where(PendingUpload.expires_at <= now)
    return session.scalars(query.order_by(PendingUpload.expires_at).limit(limit)).all()


def forget_pending_upload(session: Session, upload_id: str) -> None:
    session.execute(delete(PendingUpload).where(PendingUpload.id == upload_id))


# --- retention ------------------------------------------------------------------------------------------


def expired_jobs(session: Session, now: datetime, limit: int = 100) -> Sequence[str]:
    """Jobs whose artifacts are past their expiry and not yet deleted, the longest expired first."""
    query = select(Job.id).where(Job.artifacts_deleted.is_(False), Job.expires_at <= now)
    return session.scalars(query.order_by(Job.expires_at).limit(limit)).all()


def mark_expired(session: Session, job_id: str) -> bool:
    """Records that the expired job's artifacts were deleted from storage; False when another sweep (or a
    DELETE) recorded it first."""
    marked = session.execute(
        update(Job).where(Job.id == job_id, Job.artifacts_deleted.is_(False)).values(artifacts_deleted=True)
    ).rowcount
    if not marked:
        return False
    session.execute(delete(Artifact).where(Artifact.job_id == job_id))
    job = session.get_one(Job, job_id, populate_existing=True)
    expired = aware(job.expires_at)
    add_event(session, job, kind="status", message=f"artifacts expired at {expired:%Y-%m-%dT%H:%M:%SZ}; deleted")
    return True


# --- webhooks -------------------------------------------------------------------------------------------

# The events a webhook can receive; a job that names none receives the final ones.
FINAL_EVENTS = ("job.succeeded", "job.failed", "job.cancelled")
STAGE_EVENT = "job.stage"
WEBHOOK_EVENTS = (*FINAL_EVENTS, STAGE_EVENT)


@dataclass(frozen=True)
class Deliveries:
    """Where a kind of webhook delivery keeps its state: a job's end on the job row, a stage on its own row."""

    table: Any
    state: Any
    attempts: Any
    lease_until: Any

    def open(self, now: datetime) -> Any:
        """Still to be made, and no notifier holds it."""
        return and_(self.state == "pending", or_(self.lease_until.is_(None), self.lease_until < now))

    def claim(self, session: Session, row_id: str | int, now: datetime, lease: timedelta) -> Any:
        """Holds a pending delivery for one notifier until `now + lease`; None when another holds it or it is done."""
        claimed = session.execute(
            update(self.table).where(self.table.id == row_id, self.open(now)).values({self.lease_until: now + lease})
        ).rowcount
        return session.get_one(self.table, row_id, populate_existing=True) if claimed else None

    def attempted(self, session: Session, row_id: str | int, state: str) -> tuple[Any, str]:
        """Counts an attempt; `state` "delivered" or "failed" ends the delivery. The row, and the outcome its
        event begins with."""
        values: dict[Any, Any] = {self.attempts: self.attempts + 1, self.state: state}
        if state != "pending":
            values[self.lease_until] = None
        session.execute(update(self.table).where(self.table.id == row_id).values(values))
        outcome = "delivered" if state == "delivered" else WEBHOOK_FAILURE_PREFIX
        return session.get_one(self.table, row_id, populate_existing=True), outcome


JOB_ENDS = Deliveries(Job, Job.webhook_state, Job.webhook_attempts, Job.webhook_lease_until)
STAGES = Deliveries(StageDelivery, StageDelivery.state, StageDelivery.attempts, StageDelivery.lease_until)


def pending_webhooks(session: Session, now: datetime, limit: int = 100) -> Sequence[str]:
    """Finished jobs whose webhook is still to be delivered and that no notifier holds, longest finished first."""
    query = select(Job.id).where(JOB_ENDS.open(now), Job.status.in_(FINISHED_STATUSES))
    return session.scalars(query.order_by(Job.finished_at).limit(limit)).all()


def claim_webhook(session: Session, job_id: str, now: datetime, lease: timedelta) -> Job | None:
    return JOB_ENDS.claim(session, job_id, now, lease)


def pending_stage_deliveries(session: Session, now: datetime, limit: int = 100) -> list[tuple[int, str]]:
    """`job.stage` deliveries still to be made that no notifier holds, oldest first: (delivery id, job id)."""
    query = select(StageDelivery.id, StageDelivery.job_id).where(STAGES.open(now))
    return [(row.id, row.job_id) for row in session.execute(query.order_by(StageDelivery.id).limit(limit))]


def claim_stage_delivery(session: Session, delivery_id: int, now: datetime, lease: timedelta) -> StageDelivery | None:
    return STAGES.claim(session, delivery_id, now, lease)


def stage_delivery_attempted(session: Session, delivery_id: int, message: str, *, state: str = "pending") -> None:
    """Counts an attempt of a `job.stage` delivery, with its event on the job; as webhook_attempted."""
    delivery, outcome = STAGES.attempted(session, delivery_id, state)
    described = f"{STAGE_EVENT} {delivery.stage}, attempt {delivery.attempts}"
    job = session.get_one(Job, delivery.job_id)
    add_event(session, job, kind=WEBHOOK_EVENT_KIND, message=f"{outcome}: {message} ({described})")


def skip_webhook(session: Session, job_id: str) -> None:
    """The job ended in a way its `webhook_events` leave out: nothing is posted."""
    session.execute(update(Job).where(Job.id == job_id).values(webhook_state="skipped", webhook_lease_until=None))


def webhook_attempted(session: Session, job_id: str, message: str, *, state: str = "pending") -> int:
    """Counts an attempt with its event; `state` "delivered" or "failed" ends the delivery. Returns the attempt's
    number."""
    job, outcome = JOB_ENDS.attempted(session, job_id, state)
    add_event(session, job, kind=WEBHOOK_EVENT_KIND, message=f"{outcome}: {message} (attempt {job.webhook_attempts})")
    return job.webhook_attempts


# --- jobs as workers and the reaper see them ---------------------------------------------------------------


def claim_job(session: Session, job_id: str, worker_id: str) -> Job | None:
    """queued -> running for this worker, or None when the job is not queued (done, cancelled, or running
    elsewhere): a duplicate delivery of the same job is thereby harmless."""
    now = utcnow()
    claimed = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "queued", Job.cancel_requested.is_(False))
        .values(
            status="running",
            attempts=Job.attempts + 1,
            worker_id=worker_id,
            started_at=now,
            heartbeat_at=now,
            stage=None,
            progress=0.0,
        )
    ).rowcount
    if not claimed:
        return None
    job = session.get_one(Job, job_id, populate_existing=True)
    add_event(session, job, kind="status", message=f"running on {worker_id} (attempt {job.attempts})")
    return job


EARLIEST = datetime.min.replace(tzinfo=UTC)


def _owned_by(owner_id: str | None) -> Any:
    return Job.owner_id.is_(None) if owner_id is None else Job.owner_id == owner_id


def next_queued(session: Session, queues: Sequence[str]) -> str | None:
    """The queued job of these queues to run next. Keys take turns, so that one key's burst does not starve
    the others: the key with the fewest running jobs goes first, then the one whose last job started longest
    ago (a key that never ran one, first of all), then the one waiting longest; within a key, its oldest job."""
    waiting_query = (
        select(Job.owner_id, func.min(Job.created_at))
        .where(Job.status == "queued", Job.cancel_requested.is_(False), Job.queue.in_(queues))
        .group_by(Job.owner_id)
    )
    waiting = {owner: aware(oldest) for owner, oldest in session.execute(waiting_query)}
    if not waiting:
        return None
    owner = next(iter(waiting))
    if len(waiting) > 1:
        of_waiting = or_(*(_owned_by(key) for key in waiting))
        running_query = select(Job.owner_id, func.count()).where(of_waiting, Job.status == "running")
        running = dict(session.execute(running_query.group_by(Job.owner_id)).all())
        last_start_query = select(Job.owner_id, func.max(Job.started_at)).where(of_waiting)
        last_start = dict(session.execute(last_start_query.group_by(Job.owner_id)).all())
        owner = min(
            waiting,
            key=lambda key: (running.get(key, 0), aware(last_start.get(key)) or EARLIEST, waiting[key]),
        )
    query = select(Job.id).where(
        Job.status == "queued", Job.cancel_requested.is_(False), Job.queue.in_(queues), _owned_by(owner)
    )
    return session.scalar(query.order_by(Job.created_at, Job.id).limit(1))


def _ours(job_id: str, attempt: int) -> Any:
    return and_(Job.id == job_id, Job.status == "running", Job.attempts == attempt)


def touch(
    session: Session, job_id: str, attempt: int, *, stage: str | None = None, progress: float | None = None
) -> bool:
    """Heartbeat (and progress when given). False when the attempt no longer owns the job."""
    values: dict[str, Any] = {"heartbeat_at": utcnow()}
    if stage is not None:
        started = update(Job).where(_ours(job_id, attempt), or_(Job.stage.is_(None), Job.stage != stage))
        if session.execute(started.values(stage=stage)).rowcount:
            _stage_started(session, session.get_one(Job, job_id), attempt, stage)
    if progress is not None:
        values["progress"] = progress
    return bool(session.execute(update(Job).where(_ours(job_id, attempt)).values(**values)).rowcount)


def _stage_started(session: Session, job: Job, attempt: int, stage: str) -> None:
    """A `job.stage` delivery, where the job's webhook takes them."""
    if job.webhook_url and STAGE_EVENT in (job.webhook_events or ()):
        session.add(StageDelivery(job_id=job.id, attempt=attempt, stage=stage, started_at=utcnow()))


def release(session: Session, job_id: str, attempt: int) -> None:
    """Puts a job whose worker is shutting down back in the queue, without counting the attempt."""
    released = session.execute(
        update(Job)
        .where(_ours(job_id, attempt))
        .values(status="queued", attempts=attempt - 1, worker_id=None, stage=None, progress=0.0)
    ).rowcount
    if released:
        job = session.get_one(Job, job_id, populate_existing=True)
        add_event(session, job, kind="status", message="worker shut down; queued again")


def should_stop(session: Session, job_id: str, attempt: int) -> bool:
    """True when a cancel was requested or this attempt lost the job (reaped, finished elsewhere)."""
    row = session.execute(select(Job.status, Job.attempts, Job.cancel_requested).where(Job.id == job_id)).one_or_none()
    return row is None or row.status != "running" or row.attempts != attempt or row.cancel_requested


def finish(
    session: Session,
    job_id: str,
    attempt: int,
    *,
    status: str,
    error: tuple[str, str] | None = None,
    result: dict[str, Any] | None = None,
    artifacts: Sequence[StoredFile] = (),
    timings: dict[str, float] | None = None,
) -> bool:
    """Ends the attempt. Success is written only while no cancel is pending, so a cancel that races the
    upload still ends the job cancelled. Returns False when the row was not this attempt's to finish."""
    condition = _ours(job_id, attempt)
    if status == "succeeded":
        condition = and_(condition, Job.cancel_requested.is_(False))
    now = utcnow()
    values: dict[str, Any] = {"status": status, "finished_at": now, "result": result}
    if status == "succeeded":
        values["progress"] = 100.0
        # The retention clock starts when the artifacts are there (jobs from before retention have none).
        retention = session.scalar(select(Job.retention_seconds).where(Job.id == job_id))
        if retention is not None:
            values["expires_at"] = now + timedelta(seconds=retention)
    if error:
        values["error_code"], values["error_message"] = error
    if not session.execute(update(Job).where(condition).values(**values)).rowcount:
        return False
    session.execute(delete(Artifact).where(Artifact.job_id == job_id))
    session.add_all(Artifact(job_id=job_id, name=f.name, size=f.size, sha256=f.sha256) for f in artifacts)
    session.execute(delete(StageTiming).where(StageTiming.job_id == job_id, StageTiming.attempt == attempt))
    session.add_all(
        StageTiming(job_id=job_id, attempt=attempt, stage=stage, seconds=seconds)
        for stage, seconds in (timings or {}).items()
    )
    job = session.get_one(Job, job_id, populate_existing=True)
    add_event(session, job, kind="status", message=error[1] if error else status)
    return True


@dataclass(frozen=True)
class Reaped:
    requeued: list[tuple[str, str, datetime]]  # (job id, queue, dispatched_at) to send to the broker again
    ended: list[str]  # failed or cancelled for good


def reap(
    session: Session,
    *,
    heartbeat_timeout: float,
    max_attempts: int,
    time_limit: float,
    now: datetime | None = None,
) -> Reaped:
    """Running jobs whose worker stopped beating are queued again, or failed once they used up their
    attempts or ran past the time limit; so no job stays running forever."""
    now = now or utcnow()
    stale = session.scalars(
        select(Job).where(Job.status == "running", Job.heartbeat_at < now - timedelta(seconds=heartbeat_timeout))
    ).all()
    overdue = session.scalars(
        select(Job).where(Job.status == "running", Job.started_at < now - timedelta(seconds=time_limit))
    ).all()
    requeued, ended = [], []
    for job in {job.id: job for job in [*stale, *overdue]}.values():
        if job in overdue:
            values: dict[str, Any] = {
                "status": "failed",
                "error_code": "time_limit_exceeded",
                "error_message": f"the job ran longer than the time limit of {time_limit:.0f} s",
                "finished_at": now,
            }
            message = values["error_message"]
        elif job.cancel_requested:
            values, message = {"status": "cancelled", "finished_at": now}, "cancelled"
        elif job.attempts >= max_attempts:
            values = {
                "status": "failed",
                "error_code": "worker_lost",
                "error_message": f"the worker stopped responding in attempt {job.attempts} of {max_attempts}",
                "finished_at": now,
            }
            message = values["error_message"]
        else:
            # Nothing of a lost attempt is kept: the next one starts from the beginning, as stage and progress
            # now say; the event says where the lost one was.
            values = {"status": "queued", "worker_id": None, "stage": None, "progress": 0.0, "dispatched_at": now}
            where = f"in {job.stage} at {job.progress:.0f} %" if job.stage else "before its first stage"
            message = f"worker lost; queued again, to start over (no heartbeat for {heartbeat_timeout:.0f} s {where})"
        # Conditional on the attempt seen: a worker that finishes the job meanwhile wins.
        if not session.execute(update(Job).where(_ours(job.id, job.attempts)).values(**values)).rowcount:
            continue
        session.refresh(job)
        add_event(session, job, kind="status", message=message)
        if job.status == "queued":
            requeued.append((job.id, job.queue, now))
        else:
            ended.append(job.id)
    return Reaped(requeued, ended)


# --- whether a queued job's message reached the broker --------------------------------------------------
#
# `dispatched_at` is set before the message is sent (conditionally, so that two reapers never both send it)
# and cleared again when sending fails. A crash between the two leaves it set without a message: the broker
# check (`dispatched_before`) finds that job like one whose message the broker lost.


def claim_dispatch(session: Session, job_id: str, *, was: datetime | None, reason: str = "") -> datetime | None:
    """Marks a queued job's message as sent, if its `dispatched_at` is still `was` (None: not sent); returns the
    new mark, or None when the job is no longer queued or another process is sending it. `reason`, when
    given, becomes an event."""
    now = utcnow()
    sent = Job.dispatched_at.is_(None) if was is None else Job.dispatched_at == was
    condition = and_(Job.id == job_id, Job.status == "queued", Job.cancel_requested.is_(False), sent)
    if not session.execute(update(Job).where(condition).values(dispatched_at=now)).rowcount:
        return None
    if reason:
        add_event(session, session.get_one(Job, job_id, populate_existing=True), kind="status", message=reason)
    return now


def dispatch_failed(session: Session, job_id: str, mark: datetime, reason: str) -> None:
    """The message marked sent at `mark` never reached the broker: the reaper sends it again later.
    `reason`, when given, becomes an event (once per outage, not once per retry)."""
    unsent = session.execute(
        update(Job).where(Job.id == job_id, Job.dispatched_at == mark).values(dispatched_at=None)
    ).rowcount
    if unsent and reason:
        add_event(session, session.get_one(Job, job_id, populate_existing=True), kind="status", message=reason)


def unsent_jobs(session: Session, limit: int = 100) -> Sequence[tuple[str, str]]:
    """(id, queue) of queued jobs without a message in the broker, oldest first."""
    query = select(Job.id, Job.queue).where(
        Job.status == "queued", Job.cancel_requested.is_(False), Job.dispatched_at.is_(None)
    )
    return [(row.id, row.queue) for row in session.execute(query.order_by(Job.created_at).limit(limit))]


def dispatched_before(session: Session, cutoff: datetime) -> Sequence[tuple[str, str, datetime]]:
    """(id, queue, dispatched_at) of queued jobs whose message was sent before `cutoff`."""
    query = select(Job.id, Job.queue, Job.dispatched_at).where(
        Job.status == "queued", Job.cancel_requested.is_(False), Job.dispatched_at < cutoff
    )
    return [(row.id, row.queue, row.dispatched_at) for row in session.execute(query)]


def is_claimable(session: Session, job_id: str) -> bool:
    """What claim_job asks, without claiming: a message whose job is not claimable can be dropped unread."""
    row = session.execute(select(Job.status, Job.cancel_requested).where(Job.id == job_id)).one_or_none()
    return row is not None and row.status == "queued" and not row.cancel_requested


# --- metrics --------------------------------------------------------------------------------------------


def count_by_status(session: Session) -> dict[str, int]:
    return {status: count for status, count in session.execute(select(Job.status, func.count()).group_by(Job.status))}


def is_finished(job: Job) -> bool:
    return job.status in FINISHED_STATUSES
