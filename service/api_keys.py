"""API keys and fair use: who asks (`Caller`), which jobs it sees, and the limits on what it submits."""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.security import hash_api_key, new_api_key
from service.settings import Settings
from service.tables import (
    ApiKey,
    Artifact,
    Job,
    aware,
    new_id,
    utcnow,
)

ACTIVE_STATUSES = ("queued", "running")
# Submissions per minute are counted over the last 60 s (a sliding window, from the jobs' own rows).
SUBMISSION_WINDOW = timedelta(seconds=60)
# When one of its jobs ends is unknown: a key at its active-jobs limit is asked to come back after this.
ACTIVE_RETRY_AFTER_SECONDS = 30


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


@dataclass(frozen=True)
class Caller:
    """Who asks. `key_id` None means auth is off and every job is visible."""

    key_id: str | None


def visible_jobs(caller: Caller) -> Any:
    return True if caller.key_id is None else Job.owner_id == caller.key_id


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
    query = select(func.count()).select_from(Job).where(visible_jobs(caller), Job.status.in_(ACTIVE_STATUSES))
    return session.scalar(query) or 0


def recent_submissions(session: Session, caller: Caller, now: datetime) -> list[datetime]:
    """Creation times of the caller's jobs in the last minute, oldest first."""
    query = select(Job.created_at).where(visible_jobs(caller), Job.created_at > now - SUBMISSION_WINDOW)
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
        .where(visible_jobs(caller))
    ).one()
    return Usage(
        active_jobs=active_jobs(session, caller),
        submissions_last_minute=len(recent_submissions(session, caller, utcnow())),
        storage_bytes=int(stored[0]),
        artifact_files=int(stored[1]),
    )
