"""The service as `casp serve` runs it: the API with the reaper beside it and, without a broker, the workers
in the same process. `uvicorn --factory casp_cli.app:service_app` reads the environment."""

from typing import Any

from fastapi import FastAPI

from api.main import BackgroundService, create_app
from api.routes.jobs import job_out
from service.dispatch import Dispatcher, EmbeddedDispatcher
from service.reaper import Reaper
from service.settings import Settings
from service.storage import Storage
from service.tables import Job
from service.webhooks import Notifier


def webhook_body(job: Job) -> dict[str, Any]:
    """What a webhook posts: the job as `GET /v1/jobs/{id}` shows it."""
    return job_out(job).model_dump(mode="json")


def background_services(settings: Settings, storage: Storage, dispatcher: Dispatcher) -> list[BackgroundService]:
    # Imported here: the embedded worker pulls in the runner, which only the single-machine mode needs.
    from worker.embedded import EmbeddedWorker

    services: list[BackgroundService] = [Reaper(settings, dispatcher, storage)]
    if settings.webhook_secret:  # without a secret no job has a webhook
        services.append(Notifier(settings, webhook_body))
    if isinstance(dispatcher, EmbeddedDispatcher):
        services += [EmbeddedWorker(settings, storage, dispatcher, i) for i in range(settings.embedded_workers)]
    return services


def service_app(settings: Settings | None = None) -> FastAPI:
    return create_app(settings, background=background_services)
