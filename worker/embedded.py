"""Worker threads inside the API process for the single-machine mode: they claim queued rows directly."""

import logging
import threading

from service import job_queue
from service.db import session_scope
from service.dispatch import EmbeddedDispatcher, queue_for
from service.settings import DEVICES, Settings
from service.storage import Storage
from worker.runner import execute

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 2.0


class EmbeddedWorker(threading.Thread):
    def __init__(self, settings: Settings, storage: Storage, dispatcher: EmbeddedDispatcher, index: int) -> None:
        super().__init__(name=f"casp-worker-{index}", daemon=True)
        self.settings = settings
        self.storage = storage
        self.dispatcher = dispatcher
        self.stopped = threading.Event()

    def run(self) -> None:
        queues = [queue_for(device) for device in DEVICES]
        while not self.stopped.is_set():
            try:
                with session_scope(self.settings.database) as session:
                    job_id = job_queue.next_queued(session, queues)
                if job_id is None:
                    # Woken early by a new job; the timeout catches jobs the reaper or another process queued.
                    self.dispatcher.wake.wait(IDLE_POLL_SECONDS)
                    self.dispatcher.wake.clear()
                    continue
                execute(job_id, self.settings, self.storage, stop_requested=self.stopped.is_set)
            except Exception:
                log.exception("embedded worker round failed")
                self.stopped.wait(IDLE_POLL_SECONDS)
