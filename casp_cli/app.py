"""The service as `casp serve` runs it: the API with the reaper beside it and, without a broker, the workers
in the same process. `uvicorn --factory casp_cli.app:service_app` reads the environment."""

from fastapi import FastAPI

from api.main import BackgroundService, create_app
from service.dispatch import Dispatcher, EmbeddedDispatcher
from service.reaper import Reaper
from service.settings import Settings
from service.storage import Storage


def background_services(settings: Settings, storage: Storage, dispatcher: Dispatcher) -> list[BackgroundService]:
    # Imported here: the embedded worker pulls in the runner, which only the single-machine mode needs.
    from worker.embedded import EmbeddedWorker

    services: list[BackgroundService] = [Reaper(settings, dispatcher, storage)]
    if isinstance(dispatcher, EmbeddedDispatcher):
        services += [EmbeddedWorker(settings, storage, dispatcher, i) for i in range(settings.embedded_workers)]
    return services


def service_app(settings: Settings | None = None) -> FastAPI:
    return create_app(settings, background=background_services)
