"""A cap on request bodies (CASP_MAX_REQUEST_BYTES): 413 before a large body is read into memory."""

from fastapi import HTTPException, status
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response


def too_large(max_bytes: int) -> str:
    return f"the request body is larger than {max_bytes} bytes (CASP_MAX_REQUEST_BYTES)"


class BodyTooLarge(HTTPException):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE, too_large(max_bytes))


class RequestBodyLimit:
    """Refuses by Content-Length before reading; a body sent without one (chunked) is counted as it arrives,
    and the HTTPException raised while the route reads it becomes the usual error response."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            # Answered before a byte of the body is read.
            response = error_response(status.HTTP_413_CONTENT_TOO_LARGE, too_large(self.max_bytes))
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)
