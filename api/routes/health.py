"""/healthz, /readyz and /metrics."""

from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import text

from api import crud
from api.core.db import session_scope
from api.core.settings import Settings
from api.deps import DispatcherDep, SettingsDep, StorageDep
from api.models import JOB_STATUSES
from api.queue import Dispatcher

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(settings: SettingsDep, storage: StorageDep, dispatcher: DispatcherDep) -> JSONResponse:
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
    check("storage", storage.ping)
    ready = all(value == "ok" for value in checks.values())
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)


class JobsCollector(Collector):
    """Read from the database and the broker at scrape time: workers run in other processes, so counters
    kept in this process would see only a part of the picture."""

    def __init__(self, settings: Settings, dispatcher: Dispatcher) -> None:
        self.settings = settings
        self.dispatcher = dispatcher

    def collect(self) -> list[Metric]:
        with session_scope(self.settings.database) as session:
            counts = crud.count_by_status(session)
            durations = crud.stage_durations(session)
        jobs = GaugeMetricFamily("casp_jobs", "Jobs by status", labels=["status"])
        for status in JOB_STATUSES:
            jobs.add_metric([status], counts.get(status, 0))
        stages = SummaryMetricFamily(
            "casp_stage_duration_seconds", "Time finished attempts spent in each stage", labels=["stage"]
        )
        for stage, count, total in durations:
            stages.add_metric([stage], count_value=count, sum_value=total)
        depth = GaugeMetricFamily("casp_queue_depth", "Jobs waiting in each queue", labels=["queue"])
        for queue, waiting in self.dispatcher.depth().items():
            depth.add_metric([queue], waiting)
        return [jobs, stages, depth]


def metrics_registry(settings: Settings, dispatcher: Dispatcher) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(JobsCollector(settings, dispatcher))
    return registry


@router.get("/metrics")
def metrics(settings: SettingsDep, dispatcher: DispatcherDep) -> Response:
    return Response(generate_latest(metrics_registry(settings, dispatcher)), media_type=CONTENT_TYPE_LATEST)
