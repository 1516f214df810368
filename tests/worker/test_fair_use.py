"""Keys take turns on a real Celery worker process: a burst of one key's jobs, queued first, does not keep
another key's jobs waiting behind it; each message stays a job's own (nothing found lost, nothing run twice)."""

import pytest
import redis
from fastapi.testclient import TestClient

from service import api_keys
from service.db import session_scope
from service.reaper import LOST_MESSAGE
from service.settings import Settings
from tests.service_fixtures import TINY_JOB, WorkerProcess, finished, wait_job

pytestmark = pytest.mark.service


@pytest.mark.slow
def test_queued_jobs_of_two_keys_are_served_in_turn(
    api: TestClient, worker: WorkerProcess, distributed_settings: Settings
) -> None:
    headers = {}
    with session_scope(distributed_settings.database) as session:
        for name in ("ivan", "judy"):
            _, key = api_keys.create_api_key(session, name)
            headers[name] = {"Authorization": f"Bearer {key}"}
    # Ivan's jobs are in the queue before Judy's: first come, first served would run both of his first.
    submitted = [(name, api.post("/v1/jobs", json=TINY_JOB, headers=headers[name]).json()["id"])
                 for name in ("ivan", "ivan", "judy")]  # fmt: skip
    done = [wait_job(api, job_id, headers[name], finished, f"job {job_id}") for name, job_id in submitted]
    assert [job["status"] for job in done] == ["succeeded"] * 3, worker.log_tail()

    owner = {job_id: name for name, job_id in submitted}
    by_start = sorted(done, key=lambda job: job["started_at"])
    assert [owner[job["id"]] for job in by_start] == ["ivan", "judy", "ivan"]
    # Within a key, first come first served.
    assert [job["id"] for job in by_start if owner[job["id"]] == "ivan"] == [j for n, j in submitted if n == "ivan"]
    for name, job_id in submitted:
        job = api.get(f"/v1/jobs/{job_id}", headers=headers[name]).json()
        messages = [e["message"] for e in api.get(f"/v1/jobs/{job_id}/events", headers=headers[name]).json()["data"]]
        assert job["attempts"] == 1 and LOST_MESSAGE not in messages, messages
        assert sum(m.startswith("running on ") for m in messages) == 1, messages
    # The messages of jobs another message ran were dropped as stale: none is left behind.
    assert redis.Redis.from_url(distributed_settings.broker_url).llen("casp-cpu") == 0
