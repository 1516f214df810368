"""Takes back jobs whose worker stopped beating: queued again (and re-sent), or failed after the last attempt.

Runs as a thread in every API process (distributed and embedded): the API is always up, and the
conditional updates in crud.reap make several reapers at once harmless.
"""

import logging
import threading

from api import crud
from api.core.db import session_scope
from api.core.settings import Settings
from api.queue import Dispatcher

log = logging.getLogger(__name__)


def reap_once(settings: Settings, dispatcher: Dispatcher) -> crud.Reaped:
    with session_scope(settings.database) as session:
        reaped = crud.reap(
            session,
            heartbeat_timeout=settings.heartbeat_timeout_seconds,
            max_attempts=settings.max_attempts,
            time_limit=settings.job_time_limit_seconds,
        )
    # Sent after the commit, so a worker that receives the message finds the row queued.
    for job_id, queue in reaped.requeued:
        dispatcher.enqueue(job_id, queue)
    if reaped.requeued or reaped.ended:
        log.warning("reaper: queued again %s, ended %s", [j for j, _ in reaped.requeued], reaped.ended)
    return reaped


class Reaper(threading.Thread):
    def __init__(self, settings: Settings, dispatcher: Dispatcher) -> None:
        super().__init__(name="casp-reaper", daemon=True)
        self.settings = settings
        self.dispatcher = dispatcher
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.settings.reaper_interval_seconds):
            try:
                reap_once(self.settings, self.dispatcher)
            except Exception:  # the database may be briefly away; try again next round
                log.exception("reaper round failed")
