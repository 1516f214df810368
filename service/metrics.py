"""What /metrics reports, read from the database at scrape time (workers run in other processes, so counters
kept in one process would see only a part of the picture). Histograms are counted by SQL, one sum per bucket.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, case, func, select
from sqlalchemy.orm import Session

from service.tables import Job, JobEvent, StageTiming

# From a stage of a small model on a GPU (seconds) to one of a 70B model (hours).
STAGE_SECONDS_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800)
GIB = 1 << 30
# From a 1B model's job to what the largest GPUs hold.
PEAK_GPU_MEMORY_BUCKETS = tuple(int(gib * GIB) for gib in (0.5, 1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 80, 96, 141, 192))
PEAK_GPU_MEMORY_FIELD = "peak_gpu_memory_bytes"  # in a succeeded job's result (worker/runner.py)

# The event a webhook delivery attempt leaves (kind "webhook"); a failed attempt's message starts "failed".
WEBHOOK_EVENT_KIND = "webhook"
WEBHOOK_FAILURE_PREFIX = "failed"


@dataclass(frozen=True)
class Histogram:
    """Cumulative counts per upper bound (`buckets`, ascending, then +Inf as `count`) and the sum."""

    buckets: list[tuple[float, int]]
    count: int
    total: float

    def prometheus_buckets(self) -> list[tuple[str, float]]:
        return [*((str(float(bound)), count) for bound, count in self.buckets), ("+Inf", self.count)]


def _histogram_columns(value: ColumnElement[Any], bounds: Sequence[float]) -> list[ColumnElement[Any]]:
    counts = [func.coalesce(func.sum(case((value <= bound, 1), else_=0)), 0) for bound in bounds]
    return [*counts, func.count(value), func.coalesce(func.sum(value), 0.0)]


def _histogram(row: Sequence[Any], bounds: Sequence[float]) -> Histogram:
    *counts, count, total = row
    return Histogram(list(zip(bounds, map(int, counts), strict=True)), int(count), float(total))


def stage_durations(session: Session) -> dict[str, Histogram]:
    """Seconds each finished attempt spent in each stage, by stage."""
    columns = _histogram_columns(StageTiming.seconds, STAGE_SECONDS_BUCKETS)
    rows = session.execute(select(StageTiming.stage, *columns).group_by(StageTiming.stage).order_by(StageTiming.stage))
    return {stage: _histogram(values, STAGE_SECONDS_BUCKETS) for stage, *values in rows}


def peak_gpu_memory(session: Session) -> Histogram:
    """The peak GPU memory of each succeeded job that ran on a GPU (jobs on a CPU have none)."""
    peak = Job.result[PEAK_GPU_MEMORY_FIELD].as_float()
    row = session.execute(select(*_histogram_columns(peak, PEAK_GPU_MEMORY_BUCKETS)).where(Job.status == "succeeded"))
    return _histogram(row.one(), PEAK_GPU_MEMORY_BUCKETS)


def webhook_failures(session: Session) -> int:
    query = select(func.count()).where(
        JobEvent.kind == WEBHOOK_EVENT_KIND, JobEvent.message.startswith(WEBHOOK_FAILURE_PREFIX, autoescape=True)
    )
    return session.scalar(query) or 0


def count_by_status(session: Session) -> dict[str, int]:
    return {status: count for status, count in session.execute(select(Job.status, func.count()).group_by(Job.status))}
