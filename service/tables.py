"""Database tables. The job row, not the broker, is the truth about a job."""

import uuid
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text, and_, or_
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED_STATUSES = ("succeeded", "failed", "cancelled")


def utcnow() -> datetime:
    return datetime.now(UTC)


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def newest_first_page(session: Any, table: Any, query: Any, *, limit: int, after: str | None) -> tuple[list, bool]:
    """A page of `query`'s rows of `table`, newest first (ties by id); `after` is the id of the last row of the
    previous page. Returns the rows and whether more follow."""
    if after:
        anchor = session.get(table, after)
        if anchor is not None:
            query = query.where(
                or_(
                    table.created_at < anchor.created_at,
                    and_(table.created_at == anchor.created_at, table.id < anchor.id),
                )
            )
    rows = session.scalars(query.order_by(table.created_at.desc(), table.id.desc()).limit(limit + 1)).all()
    return list(rows[:limit]), len(rows) > limit


def new_id() -> str:
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    # Timezone-aware everywhere; SQLite drops the zone, so values read back are normalised by `aware`.
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: DateTime(timezone=True), dict[str, Any]: JSON}


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200))
    # SHA-256 of the key: keys are 256-bit random strings, so a slow password hash would add nothing.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # This key's own fair-use limits; None: the server's (CASP_MAX_ACTIVE_JOBS, CASP_MAX_SUBMISSIONS_PER_MINUTE).
    max_active_jobs: Mapped[int | None]
    max_submissions_per_minute: Mapped[int | None]
    # The key's Hugging Face token for private repositories, encrypted (Fernet) with a key derived from the server's
    # secret (service.security): used for this key's jobs only.
    hub_token: Mapped[str | None] = mapped_column(Text)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_owner_created", "owner_id", "created_at", "id"),
        Index("ix_jobs_status_heartbeat", "status", "heartbeat_at"),
        Index("ix_jobs_expires_at", "artifacts_deleted", "expires_at"),
        Index("ix_jobs_webhook_state", "webhook_state"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    stage: Mapped[str | None] = mapped_column(String(32))
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    model: Mapped[str] = mapped_column(Text)
    revision: Mapped[str | None] = mapped_column(String(200))
    device: Mapped[str] = mapped_column(String(16))
    queue: Mapped[str] = mapped_column(String(64))
    # The request's pruning settings in PruneConfig.to_dict() form, so the worker rebuilds exactly them.
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    # "<owner id or ->:<Idempotency-Key>": scoped to the owner in one column, because a unique index over
    # (owner_id, key) would not hold where owner_id is NULL (auth off).
    idempotency_key: Mapped[str | None] = mapped_column(String(300), unique=True)
    request_hash: Mapped[str | None] = mapped_column(String(64))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str | None] = mapped_column(String(255))
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    artifacts_deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    # How long the artifacts are kept after success, fixed at submit (the job's request or the server's
    # default then); `expires_at` is set from it when the job succeeds, or to the time of a DELETE.
    retention_seconds: Mapped[int | None]
    expires_at: Mapped[datetime | None]
    # Where the job's end is posted; `webhook_state` is "pending" until then, "delivered" or "failed" after.
    webhook_url: Mapped[str | None] = mapped_column(Text)
    # The events the webhook receives (`job.succeeded`, `job.failed`, `job.cancelled`, `job.stage`); None: the
    # three final ones. A final one left out ends `webhook_state` "skipped".
    webhook_events: Mapped[list[str] | None] = mapped_column(JSON)
    webhook_state: Mapped[str | None] = mapped_column(String(16))
    webhook_attempts: Mapped[int] = mapped_column(Integer, default=0)
    # A notifier delivering it holds it until then (its attempts and their waits), so two never post at once.
    webhook_lease_until: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # When the queued job's message was handed to the broker; None while it has none there (not sent yet, or
    # the broker was unreachable). The reaper sends those again, and those the broker has since lost.
    dispatched_at: Mapped[datetime | None]


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # "status", "progress" or "warning"
    status: Mapped[str] = mapped_column(String(16))
    stage: Mapped[str | None] = mapped_column(String(32))
    progress: Mapped[float] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Artifact(Base):
    __tablename__ = "artifacts"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(512), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))


class StageTiming(Base):
    """Seconds a finished attempt spent in each stage, for the stage-duration metric."""

    __tablename__ = "stage_timings"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    stage: Mapped[str] = mapped_column(String(32), primary_key=True)
    seconds: Mapped[float] = mapped_column(Float)


class UploadedModel(Base):
    """A model folder (or GGUF file) a key uploaded (`POST /v1/models`), kept in the artifact storage under
    `models/<id>/<name>/` (a GGUF file: `models/<id>/<name>`, its name ending in `.gguf`) and used by that key's jobs
    as `casp://models/<id>`. Deleted (row and files) when it expires or on DELETE."""

    __tablename__ = "uploaded_models"
    __table_args__ = (
        Index("ix_uploaded_models_owner_created", "owner_id", "created_at", "id"),
        Index("ix_uploaded_models_expires_at", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(100))  # the folder's (or file's) name: what the model card calls it
    model_type: Mapped[str] = mapped_column(String(32))
    size: Mapped[int] = mapped_column(BigInteger)  # bytes of all its files
    files: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]


class PendingUpload(Base):
    """A model upload handed out as a presigned URL (`POST /v1/models/presigned`, S3 storage only): the key PUTs its
    tar to `model-uploads/<id>.tar` in the artifact bucket, then completes it (`POST /v1/models/{id}/complete`), which
    checks the tar and makes it an UploadedModel of the same id. One never completed goes once it expires."""

    __tablename__ = "pending_uploads"
    __table_args__ = (Index("ix_pending_uploads_expires_at", "expires_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    name: Mapped[str | None] = mapped_column(String(100))  # None: the archive's top folder, or `model`
    retention_seconds: Mapped[int] = mapped_column(Integer)  # the uploaded model's, once accepted
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]


class StageDelivery(Base):
    """A `job.stage` webhook delivery: written when an attempt of a job whose `webhook_events` name it starts a
    stage, delivered by the notifiers as the job's end is (a lease, retries, each attempt an event of the job)."""

    __tablename__ = "stage_deliveries"
    __table_args__ = (Index("ix_stage_deliveries_state", "state"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)  # the job's attempt that started the stage
    stage: Mapped[str] = mapped_column(String(32))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    state: Mapped[str] = mapped_column(String(16), default="pending")  # then "delivered" or "failed"
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_until: Mapped[datetime | None]
