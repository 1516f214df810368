"""Each request's records (uvicorn's access line included) carry the job it is about and the caller's key name
(service.logs): the job id from the path here, the key name from `get_caller`, a new job's id from the route."""

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from service.logs import job_log_context

# /v1/jobs/{id}[/...] and /v1/files/{id}/{name}: the routes of one job.
JOB_PATH = re.compile(r"^/v1/(?:jobs|files)/([0-9a-f]{1,32})(?:/|$)")


class JobLogContext:
    """Pure ASGI, so that the server's access log, written when the response starts, runs in the context it
    sets (a BaseHTTPMiddleware would run the app in another task)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        match = JOB_PATH.match(scope["path"])
        # The route runs in a thread with a copy of this context: the object in it is shared, so what the
        # route notes there (a new job's id, the caller's key name) shows in the access line too.
        with job_log_context(job_id=match.group(1) if match else None):
            await self.app(scope, receive, send)
