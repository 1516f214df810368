"""Webhook deliveries as rows: which are still to be made, who holds one, and each attempt's event.

Posting them is service.webhooks'; a job's end is delivered from its own row, each `job.stage` from a row of its own.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from service.jobs import add_event
from service.metrics import WEBHOOK_EVENT_KIND, WEBHOOK_FAILURE_PREFIX
from service.tables import (
    FINISHED_STATUSES,
    Job,
    StageDelivery,
)

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
