"""The FastAPI application: `create_app(settings, background)`. What runs beside it (the reaper, the embedded
workers) is passed in by whoever starts it: `casp_cli.app` wires the service."""

import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from api import console, errors, unavailable
from api.limits import RequestBodyLimit
from api.log_context import JobLogContext
from api.methods import Options
from api.routes import files, health, jobs, keys, models, usage
from api.streams import StreamSlots, watches_for
from service.dispatch import Dispatcher, make_dispatcher
from service.settings import Settings, load_settings, local_devices, resolve_device
from service.storage import Storage, make_storage


class BackgroundService(Protocol):
    """A thread the app runs beside itself: started with the app, told to stop and joined when it shuts down."""

    stopped: threading.Event

    def start(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


# Makes the services to run beside the app, from the app's settings, storage and dispatcher.
BackgroundServices = Callable[[Settings, Storage, Dispatcher], Sequence[BackgroundService]]


def create_app(settings: Settings | None = None, background: BackgroundServices | None = None) -> FastAPI:
    settings = settings or load_settings()
    # The embedded service runs jobs on this machine, so it knows its devices: `auto` becomes one of them, and
    # a job asking for another is refused at submit. The distributed API cannot know its workers' devices.
    devices = local_devices() if settings.embedded else None
    if settings.embedded:
        settings = settings.model_copy(update={"default_device": resolve_device(settings.default_device)})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threads = background(settings, app.state.storage, app.state.dispatcher) if background else []
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
    app.state.stream_slots = StreamSlots(settings.max_streams_per_key)
    app.state.watches = watches_for(settings.database)
    errors.install(app)
    unavailable.install(app)
    app.add_middleware(
        RequestBodyLimit, max_bytes=settings.max_request_bytes, max_upload_bytes=settings.max_upload_bytes
    )
    app.add_middleware(JobLogContext)
    app.add_middleware(Options)
    app.include_router(jobs.router)
    app.include_router(models.router)
    app.include_router(keys.router)
    app.include_router(usage.router)
    app.include_router(files.router)
    app.include_router(health.router)
    console.install(app)
    return app
