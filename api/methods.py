"""Which methods a path takes, for `OPTIONS` (answered here, 204 with `Allow`) and for the `Allow` header of a
405. Starlette answers both from the first route whose path matches, so `/v1/jobs/{id}` (GET and DELETE, two
routes) showed GET alone."""

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Receive, Scope, Send

# The methods a route can take (OPTIONS is answered here for every path that takes any).
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(scope: Scope) -> list[str]:
    """Every method some route of the app takes at this path, with OPTIONS; empty when no route matches it.
    Asked of each route as the router asks (routes may be groups of routes, as FastAPI's included routers are)."""
    # A mount (the offline docs' files) matches every method: what it serves answers for itself.
    routes = [route for route in scope["app"].routes if not isinstance(route, Mount)]
    methods = [
        method
        for method in METHODS
        if any(route.matches({**scope, "method": method})[0] is Match.FULL for route in routes)
    ]
    return [*methods, "OPTIONS"] if methods else []


class Options:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        allowed = allowed_methods(scope) if scope["type"] == "http" and scope["method"] == "OPTIONS" else []
        if allowed:
            await Response(status_code=204, headers={"Allow": ", ".join(allowed)})(scope, receive, send)
            return
        await self.app(scope, receive, send)


def allow_header(request: Request) -> dict[str, str]:
    return {"Allow": ", ".join(allowed_methods(request.scope))}
