"""How a queued job reaches a worker: a Celery message, or a nudge to the in-process worker threads.

The Celery application is made here: the API and the reaper send tasks with it (no torch here), and the
workers run them with it. Queues are named after the device their jobs run on."""

import base64
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Protocol

from celery import Celery
from sqlalchemy import func, select

from service import job_queue
from service.db import session_scope
from service.settings import AUTO, DEVICES, Settings
from service.tables import Job

log = logging.getLogger(__name__)

TASK_NAME = "casp.run_job"


def queue_for(device: str) -> str:
    return f"casp-{device}"


def all_queues() -> list[str]:
    """Every queue a job can be sent to: one per device, and the one of jobs for any device."""
    return [queue_for(device) for device in (AUTO, *DEVICES)]


def make_celery(settings: Settings) -> Celery:
    app = Celery("casp", broker=settings.broker_url)
    app.conf.update(
        # One job per GPU: a worker holds one task and reserves no other, so queued jobs go to idle workers.
        worker_concurrency=1,
        worker_prefetch_multiplier=1,
        # Acknowledged only when done, and rejected back to the queue if the worker process dies.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # A fresh child per job returns all its (GPU) memory to the system.
        worker_max_tasks_per_child=1,
        # The database row carries the outcome; a result backend would only duplicate it.
        task_ignore_result=True,
        # The hard limit is a backstop behind the cooperative per-job limit checked at layer boundaries.
        task_time_limit=settings.job_time_limit_seconds + 300,
        # Unacknowledged messages come back only after this: longer than any job, so a running job is never
        # handed to a second worker by the broker; the reaper, not the broker, recovers from dead workers.
        broker_transport_options={"visibility_timeout": settings.job_time_limit_seconds + 3600},
        broker_connection_retry_on_startup=True,
        task_default_queue=queue_for(settings.default_device),
    )
    return app


class Dispatcher(Protocol):
    def enqueue(self, job_id: str, queue: str) -> None: ...

    def ping(self) -> None:
        """Raises when the broker cannot be reached."""

    def depth(self) -> dict[str, int]:
        """Jobs waiting per queue."""

    def held_job_ids(self) -> set[str] | None:
        """Jobs whose message the broker holds; None where there is no broker to lose one."""


class CeleryDispatcher:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = make_celery(settings)
        self.queues = all_queues()

    def enqueue(self, job_id: str, queue: str) -> None:
        # The message carries only the id: the row is the truth, and a repeated message is harmless.
        self.app.send_task(TASK_NAME, args=[job_id], queue=queue)

    def ping(self) -> None:
        with self.app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=2)

    @contextmanager
    def _channel(self) -> Iterator[Any]:
        """A channel to read the broker's own structures, failing at once when it is down (kombu's default
        channel would otherwise retry for seconds, and /metrics and the reaper would wait on it)."""
        with self.app.connection_for_read() as connection:
            connection.ensure_connection(max_retries=1, interval_start=0, timeout=2)
            yield connection.default_channel

    def depth(self) -> dict[str, int]:
        # Redis keeps each Celery queue as a list named after it.
        with self._channel() as channel:
            return {queue: int(channel.client.llen(queue)) for queue in self.queues}

    def held_job_ids(self) -> set[str]:
        """Messages waiting in a queue, and those delivered to a worker but not yet acknowledged, which kombu's
        Redis transport keeps in its `unacked` hash (as `[message, exchange, routing key]`) until the ack."""
        with self._channel() as channel:
            client = channel.client
            messages = [json.loads(raw) for queue in self.queues for raw in client.lrange(queue, 0, -1)]
            messages += [json.loads(raw)[0] for raw in client.hvals(channel.unacked_key)]
        return {job_id for job_id in map(job_id_of, messages) if job_id}


class EmbeddedDispatcher:
    """The in-process workers claim queued rows straight from the database; enqueueing only wakes them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.wake = threading.Event()

    def enqueue(self, job_id: str, queue: str) -> None:
        self.wake.set()

    def ping(self) -> None:
        """Nothing outside the process to reach."""

    def depth(self) -> dict[str, int]:
        with session_scope(self.settings.database) as session:
            query = select(Job.queue, func.count()).where(Job.status == "queued").group_by(Job.queue)
            return {queue: count for queue, count in session.execute(query)}

    def held_job_ids(self) -> None:
        """The workers read the database itself: nothing to lose."""


def make_dispatcher(settings: Settings) -> Dispatcher:
    return EmbeddedDispatcher(settings) if settings.embedded else CeleryDispatcher(settings)


def job_id_of(message: dict[str, Any]) -> str | None:
    """The job id in a Celery message of the run_job task (its body is `[args, kwargs, embed]`); None for
    anything else."""
    try:
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return args[0] if message["headers"]["task"] == TASK_NAME and isinstance(args[0], str) else None
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def fair_turn(settings: Settings, dispatcher: Dispatcher, job_id: str) -> str:
    """The job a worker runs for the message of `job_id`: the fairest queued job of that job's queue
    (job_queue.next_queued), so a message is a token for "a job of this queue", and keys take turns whatever order
    their messages lie in the broker.

    When that is another job, `job_id` is sent again at once, so that every queued job keeps a message of its
    own: the reaper's search for lost messages (held_job_ids) and the worker's drop of messages whose job is
    not queued (worker.tasks.JobRequest) rely on it. The other job's message, still in the queue, is then
    dropped as stale when it arrives; if another worker claims the chosen job first, this message did nothing
    and the job it named still has one."""
    with session_scope(settings.database) as session:
        row = session.execute(select(Job.queue, Job.dispatched_at).where(Job.id == job_id)).one_or_none()
        if row is None:
            return job_id
        chosen = job_queue.next_queued(session, [row.queue])
        if chosen is None or chosen == job_id:
            return job_id
        mark = job_queue.claim_dispatch(session, job_id, was=row.dispatched_at)
    if mark is not None:  # else it is no longer queued, or the reaper is sending it already
        send(settings, dispatcher, job_id, row.queue, mark, failure_event=True)
    return chosen


def send(
    settings: Settings, dispatcher: Dispatcher, job_id: str, queue: str, mark: datetime, failure_event: bool
) -> bool:
    """Sends the message of a job whose row is already marked sent at `mark` (job_queue.claim_dispatch). When the
    broker is unreachable the mark is taken back, for the reaper to send the job later, and False returned."""
    try:
        dispatcher.enqueue(job_id, queue)
        return True
    except Exception as exc:  # whatever the transport raises: the broker did not take the message
        log.warning("could not send job %s to the broker: %s", job_id, exc)
        reason = f"the broker is unreachable ({type(exc).__name__}); the job is sent when it is back"
        with session_scope(settings.database) as session:
            job_queue.dispatch_failed(session, job_id, mark, reason if failure_event else "")
        return False
