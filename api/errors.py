"""One shape for every error the API answers: `{"error": {"code", "message", "param"}}` (the OpenAI style).

`code` is machine-readable, `message` is for people, `param` names the request field at fault
(`ratio`, `calibration.n_samples`, `evaluation.perplexity.1`) or is null. Messages never repeat more than a
short excerpt of the input.
"""

import logging
from collections.abc import Sequence
from datetime import datetime
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.methods import allow_header
from service.paths import excerpt

log = logging.getLogger(__name__)

# The code of an error raised with a status only (HTTPException and FastAPI's own answers).
CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    410: "gone",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    500: "internal_error",
    503: "service_unavailable",
}
# A reason may quote a part of the input (an unknown split, a file name): cut, so no answer grows with it.
REASON_CHARS = 300
# Where a value came from is not part of its name: `body.ratio` and `query.limit` are `ratio` and `limit`.
LOCATIONS = ("body", "query", "path", "header", "cookie")


class ErrorDetail(BaseModel):
    code: str = Field(description="machine-readable, e.g. `invalid_request`, `not_found`, `conflict`")
    message: str = Field(description="what is wrong, for people")
    param: str | None = Field(description="the request field at fault, e.g. `calibration.n_samples`, or null")


class ErrorBody(BaseModel):
    error: ErrorDetail


class ApiError(StarletteHTTPException):
    """An error with a code of its own, more precise than its status's (`artifacts_expired` for a 410)."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.code = code


def artifacts_expired(expired_at: datetime | None) -> ApiError:
    """The 410 of a job whose artifacts were deleted, by the retention sweep or a DELETE (which expires them
    at once); jobs deleted before retention existed have no date."""
    at = f" at {expired_at:%Y-%m-%dT%H:%M:%SZ}" if expired_at else ""
    return ApiError(410, f"the job's artifacts expired{at} and were deleted", "artifacts_expired")


def error_response(
    status: int, message: str, *, code: str | None = None, param: str | None = None, headers: Any = None
) -> JSONResponse:
    detail = ErrorDetail(
        code=code or CODES.get(status, HTTPStatus(status).phrase.lower().replace(" ", "_")),
        message=message,
        param=param,
    )
    return JSONResponse(ErrorBody(error=detail).model_dump(), status_code=status, headers=headers)


def param_of(loc: Sequence[str | int]) -> str | None:
    parts = [str(part) for part in loc]
    if parts and parts[0] in LOCATIONS:
        parts = parts[1:]
    return excerpt(".".join(parts)) if parts else None


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = exc.code if isinstance(exc, ApiError) else None
    headers = exc.headers
    if exc.status_code == 405:
        headers = {**(headers or {}), **allow_header(request)}
    return error_response(exc.status_code, str(exc.detail), code=code, headers=headers)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    """Every problem in one message, the first one's field as `param`. The input itself is not echoed: it
    may be large, and NaN or infinity cannot even be written as JSON."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    params = [param_of(error["loc"]) for error in errors]
    message = "; ".join(
        f"{param}: {excerpt(error['msg'], REASON_CHARS)}" if param else excerpt(error["msg"], REASON_CHARS)
        for param, error in zip(params, errors, strict=True)
    )
    return error_response(422, message, param=params[0] if params else None)


async def _server_error(_: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)
    return error_response(500, "internal server error; the details are in the server's log")


def install(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _server_error)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that can answer these errors, for the OpenAPI document."""
    return {status: {"model": ErrorBody, "description": HTTPStatus(status).phrase} for status in statuses}
