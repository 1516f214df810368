"""What an operator sees of a job run by a real worker process: its JSON log lines, and /metrics read from
PostgreSQL (stage-duration histograms, peak GPU memory per job, webhook failures)."""

import json
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select, update

from service import jobs
from service.db import session_scope
from service.metrics import PEAK_GPU_MEMORY_BUCKETS, STAGE_SECONDS_BUCKETS
from service.settings import Settings
from service.tables import Job, StageTiming
from tests.service_fixtures import PROGRESS_BAR, ZERO_SHOT_JOB, WorkerProcess, finished, wait_job
from worker.runner import peak_gpu_memory

pytestmark = pytest.mark.service

GIB = 1 << 30


def scrape(api: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, by name and sorted labels."""
    response = api.get("/metrics")
    assert response.status_code == 200, response.text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def bucket_label(bound: float) -> str:
    return str(float(bound))


@pytest.fixture(scope="module")
def finished_job(api: TestClient, keys: dict[str, dict[str, str]], worker: WorkerProcess) -> dict[str, Any]:
    offset = worker.log_path.stat().st_size
    job = api.post("/v1/jobs", json=ZERO_SHOT_JOB, headers=keys["alice"]).json()
    done = wait_job(api, job["id"], keys["alice"], finished, "the job to finish")
    assert done["status"] == "succeeded", (done, worker.log_tail())
    return {"job": done, "log": worker.log_path.read_bytes()[offset:].decode()}


def test_every_record_of_a_job_run_is_a_json_line_with_its_id_key_name_and_stage(
    finished_job: dict[str, Any], distributed_settings: Settings
) -> None:
    job_id = finished_job["job"]["id"]
    records = [json.loads(line) for line in finished_job["log"].splitlines() if line.strip()]
    ours = [record for record in records if record.get("job_id") == job_id]
    assert ours, finished_job["log"][-3000:]
    # No progress bar became a record of what was printed.
    assert not [record["message"] for record in records if PROGRESS_BAR.search(record["message"])]
    assert all(record["key_name"] == "alice" for record in ours)
    assert all({"time", "level", "logger", "message"} <= set(record) for record in ours)
    # Each stage announces itself, in the record's own `stage` field; records in between carry it too.
    started = [record["stage"] for record in ours if record["message"] == f"stage {record.get('stage')} started"]
    ended = [record for record in ours if record["message"] == "attempt 1 ended succeeded"]
    assert len(ended) == 1 and ended[0]["stage"] == "upload"
    with session_scope(distributed_settings.database) as session:
        query = select(StageTiming).where(StageTiming.job_id == job_id, StageTiming.attempt == 1)
        stored = {row.stage: row.seconds for row in session.scalars(query)}
    assert started[0] == "load" and started[-1] == "upload" and set(started) == set(stored)
    # The seconds logged are those stored for the stage-duration metric.
    assert ended[0]["stage_seconds"] == pytest.approx(stored, abs=1e-3)


def test_metrics_histograms_count_what_the_database_holds(
    api: TestClient, finished_job: dict[str, Any], distributed_settings: Settings
) -> None:
    job = finished_job["job"]
    # A job on a CPU records no peak GPU memory.
    assert "peak_gpu_memory_bytes" not in job["result"]
    with session_scope(distributed_settings.database) as session:
        # Stage times on bucket bounds (an upper bound counts in its bucket) and beyond the last: a 70B job's.
        for stage, seconds in (("load", 5.0), ("pruning", 3600.0), ("allocation", 3600.5), ("evaluation", 40000.0)):
            session.add(StageTiming(job_id=job["id"], attempt=2, stage=stage, seconds=seconds))
    samples = scrape(api)
    with session_scope(distributed_settings.database) as session:
        timings = session.execute(select(StageTiming.stage, StageTiming.seconds)).all()
    assert {"load", "pruning", "upload"} <= {stage for stage, _ in timings}
    for stage in {stage for stage, _ in timings}:
        seconds = [value for name, value in timings if name == stage]
        for bound in STAGE_SECONDS_BUCKETS:
            key = ("casp_stage_duration_seconds_bucket", (("le", bucket_label(bound)), ("stage", stage)))
            assert samples[key] == sum(value <= bound for value in seconds), (stage, bound)
        assert samples[("casp_stage_duration_seconds_bucket", (("le", "+Inf"), ("stage", stage)))] == len(seconds)
        assert samples[("casp_stage_duration_seconds_count", (("stage", stage),))] == len(seconds)
        assert samples[("casp_stage_duration_seconds_sum", (("stage", stage),))] == pytest.approx(sum(seconds))

    # A GPU worker stores the job's peak in its result (the CPU test worker cannot): given one of 4 GiB, the
    # job counts in the buckets from 4 GiB up.
    before = samples[("casp_job_peak_gpu_memory_bytes_count", ())]
    with session_scope(distributed_settings.database) as session:
        session.execute(
            update(Job).where(Job.id == job["id"]).values(result={**job["result"], "peak_gpu_memory_bytes": 4 * GIB})
        )
    samples = scrape(api)
    assert samples[("casp_job_peak_gpu_memory_bytes_count", ())] == before + 1
    assert samples[("casp_job_peak_gpu_memory_bytes_sum", ())] >= 4 * GIB
    for bound in PEAK_GPU_MEMORY_BUCKETS:
        key = ("casp_job_peak_gpu_memory_bytes_bucket", (("le", bucket_label(bound)),))
        assert samples[key] == before + (bound >= 4 * GIB), bound


def test_webhook_failures_count_the_failed_delivery_events(
    api: TestClient, finished_job: dict[str, Any], distributed_settings: Settings
) -> None:
    before = scrape(api)[("casp_webhook_failures_total", ())]
    with session_scope(distributed_settings.database) as session:
        job = session.get_one(Job, finished_job["job"]["id"])
        # The events a webhook delivery leaves (issue #17, notifications): one per attempt, kind "webhook".
        for message in ("failed: HTTP 502 (attempt 1)", "failed: timed out (attempt 2)", "delivered: HTTP 200"):
            jobs.add_event(session, job, kind="webhook", message=message)
        jobs.add_event(session, job, kind="status", message="failed: not a webhook")
    assert scrape(api)[("casp_webhook_failures_total", ())] == before + 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_peak_gpu_memory_of_a_job_is_what_torch_held_at_most_since_it_started() -> None:
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    block = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    del block
    assert peak_gpu_memory(device)["peak_gpu_memory_bytes"] >= held + (256 << 20)
    assert peak_gpu_memory(torch.device("cpu")) == {}
