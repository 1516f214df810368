"""The Celery application. Imported by the API to send tasks (no torch here) and by workers to run them."""

from celery import Celery

from api.core.settings import Settings

TASK_NAME = "casp.run_job"


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
        task_default_queue=settings.queue_for(settings.default_device),
    )
    return app
