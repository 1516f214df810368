"""The Celery task: `celery -A worker.tasks worker -Q casp-cuda` (or `casp worker`)."""

from functools import cache

from api.core.settings import Settings
from api.storage import Storage, make_storage
from worker.celery_app import TASK_NAME, make_celery
from worker.runner import execute

settings = Settings()
app = make_celery(settings)


@cache
def storage() -> Storage:
    return make_storage(settings)


@app.task(name=TASK_NAME)
def run_job(job_id: str) -> str | None:
    return execute(job_id, settings, storage())
