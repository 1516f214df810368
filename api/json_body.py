"""Request bodies parsed here, so that one that is not JSON the service can read is a 422 saying where. Python's
parser gives the place of a syntax error, but for nesting deeper than it recurses (RecursionError) or an integer
longer than it converts (ValueError), neither the place nor, through FastAPI, anything but a bare 400."""

import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

# Python's own limit on the digits of an integer it converts from text (0: none).
MAX_INT_DIGITS = sys.get_int_max_str_digits()


class BodyNotReadable(HTTPException):
    def __init__(self, reason: str) -> None:
        super().__init__(422, f"the body is not JSON the service can read: {reason}")


def place(text: str, index: int) -> str:
    line = text.count("\n", 0, index) + 1
    return f"line {line} column {index - (text.rfind(chr(10), 0, index) + 1) + 1} (char {index})"


def _integer_starts(text: str, start: int) -> bool:
    """Whether a digit at `start` begins an integer's digits (not a fraction's or an exponent's)."""
    before = text[start - 1] if start else ""
    if before in "+-":
        before = text[start - 2] if start > 1 else ""
        return before not in ("e", "E")
    return before not in (".", "e", "E")


def what_failed(text: str) -> str:
    """Where a text the parser gave up on without a place goes beyond it: the first integer longer than
    MAX_INT_DIGITS, else the deepest nesting."""
    depth = deepest = deepest_at = 0
    in_string = escaped = False
    digits_from: int | None = None
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if "0" <= char <= "9":
            if digits_from is None:
                digits_from = index
            if MAX_INT_DIGITS and index - digits_from >= MAX_INT_DIGITS and _integer_starts(text, digits_from):
                return f"an integer longer than {MAX_INT_DIGITS} digits at {place(text, digits_from)}"
            continue
        digits_from = None
        if char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest, deepest_at = depth, index
        elif char in "]}":
            depth -= 1
    return f"nested {deepest} levels deep, too deep to read, the deepest at {place(text, deepest_at)}"


def parse_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyNotReadable(f"not UTF-8 at byte {exc.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BodyNotReadable(f"{exc.msg} at {place(text, exc.pos)}") from None
    except (RecursionError, ValueError):
        raise BodyNotReadable(what_failed(text)) from None


class JsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class JsonRoute(APIRoute):
    """FastAPI reads a JSON body with `request.json()`: this route hands it a request that parses as above."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_here(request: Request) -> Response:
            return await handler(JsonRequest(request.scope, request.receive))

        return parse_here
