"""Retention: the jobs whose artifacts are past their expiry, and the record that they were deleted."""

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from service.jobs import add_event
from service.tables import (
    Artifact,
    Job,
    aware,
)


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
