"""How a queued job reaches a worker: a Celery message, or a nudge to the in-process worker threads."""

import threading
from typing import Protocol

from sqlalchemy import func, select

from api.core.db import session_scope
from api.core.settings import DEVICES, Settings
from api.models import Job
from worker.celery_app import TASK_NAME, make_celery


class Dispatcher(Protocol):
    def enqueue(self, job_id: str, queue: str) -> None: ...

    def ping(self) -> None:
        """Raises when the broker cannot be reached."""

    def depth(self) -> dict[str, int]:
        """Jobs waiting per queue."""


class CeleryDispatcher:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = make_celery(settings)

    def enqueue(self, job_id: str, queue: str) -> None:
        # The message carries only the id: the row is the truth, and a repeated message is harmless.
        self.app.send_task(TASK_NAME, args=[job_id], queue=queue)

    def ping(self) -> None:
        with self.app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=2)

    def depth(self) -> dict[str, int]:
        # Redis keeps each Celery queue as a list named after it.
        with self.app.connection_for_read() as connection:
            client = connection.default_channel.client
            return {queue: int(client.llen(queue)) for queue in map(self.settings.queue_for, DEVICES)}


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


def make_dispatcher(settings: Settings) -> Dispatcher:
    return EmbeddedDispatcher(settings) if settings.embedded else CeleryDispatcher(settings)
