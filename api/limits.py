"""A cap on request bodies (CASP_MAX_REQUEST_BYTES; a model upload's, CASP_MAX_UPLOAD_BYTES): 413 before a large body
is read into memory."""

from fastapi import HTTPException, status
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response

# The one request whose body is a model, not a few KiB of JSON.
UPLOAD = ("POST", "/v1/models")


def too_large(max_bytes: int, setting: str) -> str:
    return f"the request body is larger than {max_bytes} bytes ({setting})"


class BodyTooLarge(HTTPException):
    def __init__(self, max_bytes: int, setting: str) -> None:
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE, too_large(max_bytes, setting))


class RequestBodyLimit:
    """Refuses by Content-Length before reading; a body sent without one (chunked) is counted as it arrives,
    and the HTTPException raised while the route reads it becomes the usual error response."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_upload_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_upload_bytes = max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (scope["method"], scope["path"].rstrip("/")) == UPLOAD:
            max_bytes, setting = self.max_upload_bytes, "CASP_MAX_UPLOAD_BYTES"
        else:
            max_bytes, setting = self.max_bytes, "CASP_MAX_REQUEST_BYTES"
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > max_bytes:
            # Answered before a byte of the body is read.
            response = error_response(status.HTTP_413_CONTENT_TOO_LARGE, too_large(max_bytes, setting))
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise BodyTooLarge(max_bytes, setting)
            return message

        await self.app(scope, counting_receive, send)
