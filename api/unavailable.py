"""503 answers when a dependency the request needs (the database) is down: the client should retry, not give
up, so the answer says when (Retry-After)."""

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from api.errors import error_response

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5
# What SQLAlchemy raises when it cannot reach or keep the database (refused, dropped); other database errors
# are bugs or conflicts, not outages.
DATABASE_DOWN = (OperationalError, InterfaceError)


def database_down(request: Request, exc: Exception) -> JSONResponse:
    log.warning("%s %s: the database is unreachable: %s", request.method, request.url.path, exc)
    return error_response(
        503, "the database is unreachable; retry later", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
    )


def pool_exhausted(request: Request, exc: Exception) -> JSONResponse:
    """The database is up, but every connection of this process's pool stayed busy for the pool's timeout:
    this process is overloaded, which is another thing to alert on than an outage."""
    log.warning("%s %s: the database connection pool is exhausted: %s", request.method, request.url.path, exc)
    return error_response(
        503,
        "the server is overloaded: every database connection of its pool is in use; retry later",
        code="database_pool_exhausted",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def install(app: FastAPI) -> None:
    for error in DATABASE_DOWN:
        app.add_exception_handler(error, database_down)
    app.add_exception_handler(PoolTimeout, pool_exhausted)
