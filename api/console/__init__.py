"""The console: pages at /console for people, over the same HTTP API that clients use.

The pages are Jinja2 shells; their scripts (static/*.js, plain ES modules, no build step) call /v1/... with the
key the person entered, kept in the tab's sessionStorage, so a page shows exactly what the key may see. Every asset
is served from here, and the Content-Security-Policy lets the page reach its own origin alone (and, on S3
storage, the bucket its signed artifact links point at).
"""

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from api.deps import SettingsDep
from api.schemas import JobId
from service.settings import Settings
from service.tables import JOB_STATUSES

HERE = Path(__file__).parent
PREFIX = "/console"
STATIC = f"{PREFIX}/static"
templates = Jinja2Templates(directory=HERE / "templates")
router = APIRouter(prefix=PREFIX, include_in_schema=False)


def storage_origin(settings: Settings) -> str:
    """Where signed artifact links point when they are not this server's: the S3 endpoint clients reach."""
    if not settings.storage.startswith("s3://"):
        return ""
    endpoint = settings.s3_public_endpoint_url or settings.s3_endpoint_url
    if endpoint is None:  # AWS itself: the bucket's virtual host
        return "https://*.amazonaws.com"
    parts = urlsplit(endpoint)
    return f"{parts.scheme}://{parts.netloc}"


def content_security_policy(settings: Settings) -> str:
    storage = storage_origin(settings)
    own = f"'self' {storage}".strip()
    return (
        f"default-src 'none'; script-src 'self'; style-src 'self'; img-src {own}; connect-src {own};"
        " form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    )


def page(request: Request, settings: Settings, template: str, title: str, **context: Any) -> HTMLResponse:
    response = templates.TemplateResponse(
        request,
        template,
        {"title": title, "auth": settings.auth, "static": STATIC, "prefix": PREFIX, **context},
    )
    response.headers["Content-Security-Policy"] = content_security_policy(settings)
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


@router.get("", response_class=HTMLResponse)
def jobs_page(request: Request, settings: SettingsDep) -> HTMLResponse:
    return page(request, settings, "jobs.html", "Jobs", statuses=JOB_STATUSES)


@router.get("/", response_class=RedirectResponse)
def console_root() -> RedirectResponse:
    return RedirectResponse(PREFIX)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: JobId, request: Request, settings: SettingsDep) -> HTMLResponse:
    # Whether the job exists, and is the caller's, is the API's to say: the page asks it with the caller's key.
    return page(request, settings, "job.html", f"Job {job_id}", job_id=job_id)


@router.get("/new", response_class=HTMLResponse)
def new_job_page(request: Request, settings: SettingsDep) -> HTMLResponse:
    return page(request, settings, "new.html", "New job")


@router.get("/usage", response_class=HTMLResponse)
def usage_page(request: Request, settings: SettingsDep) -> HTMLResponse:
    return page(request, settings, "usage.html", "Usage and limits")


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount(STATIC, StaticFiles(directory=HERE / "static"), name="console-static")
