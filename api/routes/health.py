"""/healthz, /readyz and /metrics."""

import logging
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.security.utils import get_authorization_scheme_param
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from api.deps import DispatcherDep, SettingsDep, StorageDep, get_caller
from api.errors import error_response, responses
from service.db import session_scope
from service.dispatch import Dispatcher
from service.metrics import count_by_status, peak_gpu_memory, stage_durations, webhook_failures
from service.settings import Settings
from service.tables import JOB_STATUSES

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


def authenticated(request: Request, settings: Settings) -> bool:
    """Whether the caller holds a valid API key (or auth is off); False, too, when that cannot be checked.

    The header is read here, with FastAPI's own parser, rather than through the bearer dependency: /readyz is
    open to anyone, and the dependency would list it in the OpenAPI document as needing a key."""
    scheme, token = get_authorization_scheme_param(request.headers.get("Authorization"))
    credentials = HTTPAuthorizationCredentials(scheme=scheme, credentials=token) if scheme.lower() == "bearer" else None
    try:
        with session_scope(settings.database) as session:
            get_caller(settings, session, credentials)
        return True
    except (HTTPException, SQLAlchemyError):
        return False


@router.get("/readyz", responses=responses(503))
def readyz(request: Request, settings: SettingsDep, storage: StorageDep, dispatcher: DispatcherDep) -> JSONResponse:
    """Ready: the database answers, the broker answers, and the artifact storage takes a file and has at
    least CASP_READY_MIN_FREE_BYTES free. Only callers with an API key see which check failed (the log
    always says). Not ready is a 503 in the API's error shape, code `not_ready`."""
    checks: dict[str, str] = {}

    def check(name: str, probe: Any) -> None:
        try:
            probe()
            checks[name] = "ok"
        except Exception as exc:
            checks[name] = f"{type(exc).__name__}: {exc}"

    def database() -> None:
        with session_scope(settings.database) as session:
            session.execute(text("SELECT 1"))

    check("database", database)
    check("broker", dispatcher.ping)
    check("storage", lambda: storage.check_writable(settings.ready_min_free_bytes))
    failed = {name: value for name, value in checks.items() if value != "ok"}
    detailed = authenticated(request, settings)
    if failed:
        log.warning("not ready: %s", failed)
        reasons = "; ".join(f"{name}: {value}" for name, value in failed.items())
        return error_response(503, f"not ready: {reasons}" if detailed else "not ready", code="not_ready")
    body: dict[str, Any] = {"ready": True}
    if detailed:
        body["checks"] = checks
    return JSONResponse(body)


class JobsCollector(Collector):
    """Read from the database (service.metrics) and the broker at scrape time."""

    def __init__(self, settings: Settings, dispatcher: Dispatcher) -> None:
        self.settings = settings
        self.dispatcher = dispatcher

    def collect(self) -> list[Metric]:
        with session_scope(self.settings.database) as session:
            counts = count_by_status(session)
            durations = stage_durations(session)
            peaks = peak_gpu_memory(session)
            failed_webhooks = webhook_failures(session)
        by_status = GaugeMetricFamily("casp_jobs", "Jobs by status", labels=["status"])
        for status in JOB_STATUSES:
            by_status.add_metric([status], counts.get(status, 0))
        stages = HistogramMetricFamily(
            "casp_stage_duration_seconds", "Time finished attempts spent in each stage", labels=["stage"]
        )
        for stage, histogram in durations.items():
            stages.add_metric([stage], histogram.prometheus_buckets(), histogram.total)
        peak_memory = HistogramMetricFamily(
            "casp_job_peak_gpu_memory_bytes", "Peak GPU memory torch allocated, per succeeded job on a GPU"
        )
        peak_memory.add_metric([], peaks.prometheus_buckets(), peaks.total)
        webhooks = CounterMetricFamily(
            "casp_webhook_failures", "Webhook delivery attempts that failed (events of kind webhook)"
        )
        webhooks.add_metric([], failed_webhooks)
        depth = GaugeMetricFamily("casp_queue_depth", "Jobs waiting in each queue", labels=["queue"])
        broker_up = GaugeMetricFamily("casp_broker_up", "1 when the broker answered this scrape, else 0")
        try:
            waiting, up = self.dispatcher.depth(), 1
        except Exception as exc:  # whatever the transport raises: the metrics still answer, saying so
            log.warning("metrics: the broker is unreachable: %s", exc)
            waiting, up = {}, 0
        broker_up.add_metric([], up)
        for queue, count in waiting.items():
            depth.add_metric([queue], count)
        return [by_status, stages, peak_memory, webhooks, depth, broker_up]


def metrics_registry(settings: Settings, dispatcher: Dispatcher) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(JobsCollector(settings, dispatcher))
    return registry


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(settings: SettingsDep, dispatcher: DispatcherDep) -> Response:
    return Response(generate_latest(metrics_registry(settings, dispatcher)), media_type=CONTENT_TYPE_LATEST)
