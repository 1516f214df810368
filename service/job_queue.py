"""Jobs as the workers and the reaper see them: claimed, kept alive, finished, reaped, and sent to the broker.

State changes are conditional UPDATEs on the attempt (`... AND attempts = n`): two workers, the reaper and a cancel
request can race, and the row must end in exactly one consistent state.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.orm import Session

from service.jobs import add_event
from service.storage import StoredFile
from service.tables import (
    Artifact,
    Job,
    StageDelivery,
    StageTiming,
    aware,
    utcnow,
)
from service.webhook_deliveries import STAGE_EVENT


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
