"""The Celery task: `celery -A worker.tasks worker -Q casp-cuda,casp-auto` (or `casp worker`)."""

import logging
from functools import cache

from celery.signals import setup_logging
from celery.worker.request import Request
from celery.worker.state import task_ready
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from service import job_queue
from service.dispatch import TASK_NAME, CeleryDispatcher, fair_turn, make_celery
from service.logs import configure_logging, install_record_context
from service.settings import load_settings
from service.storage import Storage, make_storage
from worker.runner import execute

log = logging.getLogger(__name__)

settings = load_settings()  # a wrong variable: one line naming it (casp worker checked it already)
app = make_celery(settings)


def json_logging(loglevel: int, **_: object) -> None:
    """Celery's `setup_logging` signal: with a receiver, Celery leaves the logging setup to it. The pool's
    children inherit it; what is printed (a library's progress bar) becomes a record too, as Celery does."""
    configure_logging("json", loglevel)
    app.log.redirect_stdouts("WARNING")


install_record_context()
if settings.log_format == "json":
    setup_logging.connect(json_logging, weak=False)


@cache
def storage() -> Storage:
    return make_storage(settings)


@cache
def dispatcher() -> CeleryDispatcher:
    return CeleryDispatcher(settings)


@cache
def _main_process_engine() -> Engine:
    # No pool: the main process forks the pool's children, which must not inherit its open connections.
    return create_engine(settings.database, poolclass=NullPool)


class JobRequest(Request):
    """Drops, in the worker's main process, a message whose job is not queued (cancelled, finished, or running
    elsewhere), so that it never reaches the pool. Each message the pool runs costs a fresh child process
    (`worker_max_tasks_per_child=1`): stale messages of cancelled jobs used to drain at about 1.5 a second
    ahead of the live jobs behind them."""

    def revoked(self) -> bool:
        if super().revoked():
            return True
        job_id = self.args[0]
        try:
            with Session(_main_process_engine()) as session:
                if job_queue.is_claimable(session, job_id):
                    return False
        except SQLAlchemyError:  # the database is away: the pool's run of the task deals with that as before
            log.warning("could not check job %s before running it", job_id, exc_info=True)
            return False
        log.info("job %s is not queued; nothing to do", job_id)
        # What Celery does for a revoked task, less the result backend (there is none).
        task_ready(self)
        self.acknowledge()
        self._already_revoked = True
        return True


@app.task(name=TASK_NAME, Request=JobRequest)
def job_task(job_id: str) -> str | None:
    """The Celery task of a job (its wire name stays `casp.run_job`, so messages already queued still run).
    It runs the fairest queued job of the message's queue, which need not be the message's own (fair_turn)."""
    return execute(fair_turn(settings, dispatcher(), job_id), settings, storage())
