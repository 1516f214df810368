"""Jobs as the API sees them: created, listed, read, cancelled, with their events and artifacts.

State changes of a job are conditional UPDATEs (`... WHERE status = 'queued'`, `... AND attempts = n`): two
workers, the reaper and a cancel request can race, and the row must end in exactly one consistent state.
"""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.api_keys import Caller, Limits, check_limits, visible_jobs
from service.events import note_event
from service.tables import (
    FINISHED_STATUSES,
    Artifact,
    Job,
    JobEvent,
    new_id,
    newest_first_page,
    utcnow,
)


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different request body."""


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
    return session.scalar(select(Job).where(Job.id == job_id, visible_jobs(caller)))


def list_jobs(
    session: Session, caller: Caller, *, status: str | None, limit: int, after: str | None
) -> tuple[Sequence[Job], bool]:
    """Newest first; `after` is the id of the last job of the previous page."""
    query = select(Job).where(visible_jobs(caller))
    if status:
        query = query.where(Job.status == status)
    return newest_first_page(session, Job, query, limit=limit, after=after)


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


def is_finished(job: Job) -> bool:
    return job.status in FINISHED_STATUSES
