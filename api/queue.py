"""How a queued job reaches a worker: a Celery message, or a nudge to the in-process worker threads."""

import base64
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import func, select

from api import crud
from api.core.db import session_scope
from api.core.settings import Settings
from api.models import Job
from worker.celery_app import TASK_NAME, make_celery

log = logging.getLogger(__name__)


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
        self.queues = settings.queues()

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


def send(
    settings: Settings, dispatcher: Dispatcher, job_id: str, queue: str, mark: datetime, failure_event: bool
) -> bool:
    """Sends the message of a job whose row is already marked sent at `mark` (crud.claim_dispatch). When the
    broker is unreachable the mark is taken back, for the reaper to send the job later, and False returned."""
    try:
        dispatcher.enqueue(job_id, queue)
        return True
    except Exception as exc:  # whatever the transport raises: the broker did not take the message
        log.warning("could not send job %s to the broker: %s", job_id, exc)
        reason = f"the broker is unreachable ({type(exc).__name__}); the job is sent when it is back"
        with session_scope(settings.database) as session:
            crud.dispatch_failed(session, job_id, mark, reason if failure_event else "")
        return False
