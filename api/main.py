"""The FastAPI application: `create_app(settings)`; `uvicorn --factory api.main:app` reads the environment."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.core.settings import Settings
from api.queue import EmbeddedDispatcher, make_dispatcher
from api.routes import files, health, jobs
from api.storage import make_storage


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

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

    app = FastAPI(
        title="casp",
        version="0.1.0",
        description="Jobs service for Correlation-Aware Structured Pruning of LLMs",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.storage = make_storage(settings)
    app.state.dispatcher = make_dispatcher(settings)
    app.include_router(jobs.router)
    app.include_router(files.router)
    app.include_router(health.router)
    return app


def app() -> FastAPI:
    """Factory for `uvicorn --factory api.main:app`."""
    return create_app()
