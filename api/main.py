"""The FastAPI application: `create_app(settings)`; `uvicorn --factory api.main:app` reads the environment."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from api import errors, unavailable
from api.core.settings import Settings, local_devices, resolve_device
from api.limits import RequestBodyLimit
from api.queue import EmbeddedDispatcher, make_dispatcher
from api.routes import files, health, jobs
from api.storage import make_storage


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    # The embedded service runs jobs on this machine, so it knows its devices: `auto` becomes one of them, and
    # a job asking for another is refused at submit. The distributed API cannot know its workers' devices.
    devices = local_devices() if settings.embedded else None
    if settings.embedded:
        settings = settings.model_copy(update={"default_device": resolve_device(settings.default_device)})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Imported here: the worker modules pull in the runner, which is only needed once the app starts.
        from worker.embedded import EmbeddedWorker
        from worker.reaper import Reaper

        threads = [Reaper(settings, app.state.dispatcher)]
        if isinstance(app.state.dispatcher, EmbeddedDispatcher):
            threads += [
                EmbeddedWorker(settings, app.state.storage, app.state.dispatcher, i)
                for i in range(settings.embedded_workers)
            ]
        for thread in threads:
            thread.start()
        yield
        for thread in threads:
            thread.stopped.set()
        for thread in threads:
            thread.join()

    # FastAPIOffline: /docs and /redoc load their scripts and styles from this service, not from a CDN.
    app = FastAPIOffline(
        title="casp",
        version="0.1.0",
        description="Jobs service for Correlation-Aware Structured Pruning of LLMs",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.devices = devices
    app.state.storage = make_storage(settings)
    app.state.dispatcher = make_dispatcher(settings)
    errors.install(app)
    unavailable.install(app)
    app.add_middleware(RequestBodyLimit, max_bytes=settings.max_request_bytes)
    app.include_router(jobs.router)
    app.include_router(files.router)
    app.include_router(health.router)
    return app


def app() -> FastAPI:
    """Factory for `uvicorn --factory api.main:app`."""
    return create_app()
