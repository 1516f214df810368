"""Per-key limits at submit (429 with Retry-After, the limit named), what /v1/usage reports, and the OpenAPI
document showing both; against PostgreSQL, Redis and S3. Jobs go to the `cuda` queue, which no test worker
reads, so they stay queued (active) until cancelled."""

import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from service import api_keys, job_queue
from service.db import session_scope
from service.settings import Settings
from service.storage import StoredFile
from service.tables import ApiKey, Job
from tests.api.test_api import PARKED, refusal
from tests.service_fixtures import REPO, settings_env

pytestmark = pytest.mark.service


def new_key(settings: Settings, name: str, **limits: int) -> dict[str, str]:
    with session_scope(settings.database) as session:
        _, key = api_keys.create_api_key(session, name, **limits)
    return {"Authorization": f"Bearer {key}"}


def submit(api: TestClient, headers: dict[str, str], **extra: Any) -> Any:
    return api.post("/v1/jobs", json=PARKED, headers={**headers, **extra})


def test_a_key_at_its_active_jobs_limit_is_refused_until_one_ends(
    api: TestClient, distributed_settings: Settings
) -> None:
    dave = new_key(distributed_settings, "dave", max_active_jobs=2)
    first = submit(api, dave, **{"Idempotency-Key": "first"}).json()
    second = submit(api, dave).json()

    refused = submit(api, dave)
    error = refusal(refused, 429)
    assert error["code"] == "max_active_jobs_exceeded" and error["param"] is None
    assert "2 jobs queued or running" in error["message"] and "max_active_jobs is 2" in error["message"]
    assert refused.headers["Retry-After"] == str(api_keys.ACTIVE_RETRY_AFTER_SECONDS)
    # A replay of a job that exists is no new job: answered as before, not refused.
    replay = submit(api, dave, **{"Idempotency-Key": "first"})
    assert replay.status_code == 201 and replay.json()["id"] == first["id"]
    # Another key is not held to dave's limit (nor to the server's, which is far above).
    erin = new_key(distributed_settings, "erin")
    other = submit(api, erin)
    assert other.status_code == 201

    api.post(f"/v1/jobs/{first['id']}/cancel", headers=dave)
    third = submit(api, dave)
    assert third.status_code == 201, third.text
    for job_id, headers in ((second["id"], dave), (third.json()["id"], dave), (other.json()["id"], erin)):
        api.post(f"/v1/jobs/{job_id}/cancel", headers=headers)


def test_submissions_per_minute_are_counted_over_the_last_60_seconds(
    api: TestClient, distributed_settings: Settings
) -> None:
    frank = new_key(distributed_settings, "frank", max_submissions_per_minute=3)
    ids = [submit(api, frank).json()["id"] for _ in range(3)]
    for job_id in ids:  # cancelled: the active-jobs limit plays no part
        api.post(f"/v1/jobs/{job_id}/cancel", headers=frank)

    refused = submit(api, frank)
    error = refusal(refused, 429)
    assert error["code"] == "max_submissions_per_minute_exceeded"
    assert "submitted 3 jobs in the last minute" in error["message"]
    assert "max_submissions_per_minute is 3" in error["message"]
    # The place frees when the first of the three leaves the window, within the minute.
    assert 1 <= int(refused.headers["Retry-After"]) <= 60

    # The first submission 61 s ago: out of the window, one place is free again, and then none.
    with session_scope(distributed_settings.database) as session:
        created = session.get_one(Job, ids[0]).created_at
        session.execute(update(Job).where(Job.id == ids[0]).values(created_at=created - timedelta(seconds=61)))
    fourth = submit(api, frank)
    assert fourth.status_code == 201, fourth.text
    api.post(f"/v1/jobs/{fourth.json()['id']}/cancel", headers=frank)
    assert submit(api, frank).status_code == 429


def test_usage_reports_the_limits_the_active_jobs_and_the_storage(
    api: TestClient, distributed_settings: Settings
) -> None:
    grace = new_key(distributed_settings, "grace", max_active_jobs=5)
    queued = submit(api, grace).json()
    done = submit(api, grace).json()
    # The second job "runs" and succeeds with two artifacts of known size (the pipeline plays no part here).
    with session_scope(distributed_settings.database) as session:
        claimed = job_queue.claim_job(session, done["id"], "usage-test")
        assert claimed is not None
        stored = [StoredFile("model.safetensors", 1000, "0" * 64), StoredFile("report.json", 24, "1" * 64)]
        assert job_queue.finish(session, done["id"], claimed.attempts, status="succeeded", artifacts=stored)

    usage = api.get("/v1/usage", headers=grace).json()
    assert usage == {
        "key_name": "grace",
        "limits": {"max_active_jobs": 5, "max_submissions_per_minute": 1000},
        "active_jobs": 1,
        "submissions_last_minute": 2,
        "storage_bytes": 1024,
        "artifact_files": 2,
    }
    # Deleting the artifacts frees their storage.
    assert api.delete(f"/v1/jobs/{done['id']}", headers=grace).status_code == 204
    assert api.get("/v1/usage", headers=grace).json()["storage_bytes"] == 0
    api.post(f"/v1/jobs/{queued['id']}/cancel", headers=grace)
    assert api.get("/v1/usage").status_code == 401


def test_keys_create_sets_the_keys_own_limits(api: TestClient, distributed_settings: Settings) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "casp_cli.main", "keys", "create", "--name", "heidi", "--max-active-jobs", "3",
         "--max-submissions-per-minute", "7"],
        cwd=REPO,
        env=settings_env(distributed_settings),
        capture_output=True,
        text=True,
        check=True,
    )  # fmt: skip
    with session_scope(distributed_settings.database) as session:
        row = api_keys.find_api_key(session, result.stdout.strip())
        assert isinstance(row, ApiKey)
        assert (row.max_active_jobs, row.max_submissions_per_minute) == (3, 7)


def test_retention_is_asked_within_the_servers_maximum(
    api: TestClient, keys: dict[str, dict[str, str]], distributed_settings: Settings
) -> None:
    longest = distributed_settings.max_artifact_retention_seconds
    response = api.post("/v1/jobs", json={**PARKED, "retention_seconds": longest + 1}, headers=keys["alice"])
    error = refusal(response)
    assert error["param"] == "retention_seconds" and f"at most {longest} s" in error["message"]
    assert refusal(api.post("/v1/jobs", json={**PARKED, "retention_seconds": 0}, headers=keys["alice"]))
    job = api.post("/v1/jobs", json={**PARKED, "retention_seconds": 3600}, headers=keys["alice"]).json()
    # Queued: no artifacts, no expiry yet; the clock starts at success.
    assert job["expires_at"] is None
    api.post(f"/v1/jobs/{job['id']}/cancel", headers=keys["alice"])


def test_the_openapi_document_shows_limits_and_retention(api: TestClient) -> None:
    document = api.get("/openapi.json").json()
    paths, schemas = document["paths"], document["components"]["schemas"]
    assert "429" in paths["/v1/jobs"]["post"]["responses"]
    assert "410" in paths["/v1/jobs/{job_id}/artifacts"]["get"]["responses"]
    assert "410" in paths["/v1/files/{job_id}/{name}"]["get"]["responses"]
    retention = schemas["JobCreate"]["properties"]["retention_seconds"]
    assert "CASP_MAX_ARTIFACT_RETENTION_SECONDS" in retention["description"]
    assert "expires_at" in schemas["JobOut"]["properties"]
    assert set(schemas["UsageOut"]["properties"]) >= {"limits", "active_jobs", "storage_bytes"}
    assert "get" in paths["/v1/usage"]
