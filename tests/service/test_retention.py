"""Artifacts expire: the sweep beside the reaper deletes them from storage (S3 with a Celery worker, a local
folder with the embedded worker), marks the job with an event, and `GET` on them answers 410 with the date."""

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from fastapi.testclient import TestClient

from casp_cli.app import service_app
from service import api_keys, job_queue, jobs
from service.db import session_scope
from service.migrate import upgrade
from service.settings import Settings
from service.storage import make_storage
from tests.service_fixtures import (
    FIXTURE_DATA,
    REPO,
    S3_ACCESS,
    S3_SECRET,
    TINY_JOB,
    WorkerProcess,
    download,
    finished,
    wait_for,
    wait_job,
)

pytestmark = pytest.mark.service

RETENTION_SECONDS = 3


def swept(api: TestClient, job_id: str, headers: dict[str, str]) -> bool:
    events = api.get(f"/v1/jobs/{job_id}/events", headers=headers).json()["data"]
    return any(e["message"].startswith("artifacts expired at ") for e in events)


def succeeded_with_expiry(api: TestClient, headers: dict[str, str], what: str) -> dict[str, Any]:
    job = api.post("/v1/jobs", json={**TINY_JOB, "retention_seconds": RETENTION_SECONDS}, headers=headers).json()
    done = wait_job(api, job["id"], headers, finished, what)
    assert done["status"] == "succeeded", done
    finished_at, expires_at = (datetime.fromisoformat(done[k]) for k in ("finished_at", "expires_at"))
    assert expires_at - finished_at == timedelta(seconds=RETENTION_SECONDS)
    return done


def assert_gone(api: TestClient, done: dict[str, Any], headers: dict[str, str], url: str) -> None:
    """410 with the date, on the artifact list and on a download URL the API signed before."""
    expired_at = datetime.fromisoformat(done["expires_at"]).strftime("%Y-%m-%dT%H:%M:%SZ")
    for response in (api.get(f"/v1/jobs/{done['id']}/artifacts", headers=headers), api.get(url)):
        assert response.status_code == 410, response.text
        assert response.json()["error"]["code"] == "artifacts_expired"
        assert f"expired at {expired_at}" in response.json()["error"]["message"]


def work_file(folder: Path) -> Path:
    path = folder / "recovery-state.pt"
    path.write_bytes(b"training state")
    return path


@pytest.mark.slow
def test_expired_artifacts_are_deleted_from_s3(
    api: TestClient,
    worker: WorkerProcess,
    distributed_settings: Settings,
    s3_server: dict[str, str],
    tmp_path: Path,
) -> None:
    with session_scope(distributed_settings.database) as session:
        _, key = api_keys.create_api_key(session, "keeper")
    headers = {"Authorization": f"Bearer {key}"}
    done = succeeded_with_expiry(api, headers, "the job to succeed")
    artifacts = api.get(f"/v1/jobs/{done['id']}/artifacts", headers=headers).json()["data"]
    assert download(artifacts[0]["url"]).status_code == 200
    assert api.get("/v1/usage", headers=headers).json()["storage_bytes"] == sum(a["size"] for a in artifacts) > 0
    # Work in progress a job left behind (its worker could not remove it) goes with the artifacts.
    make_storage(distributed_settings).put_work(done["id"], work_file(tmp_path))

    # The API's reaper (every second here) sweeps it once its time has come.
    wait_for(lambda: swept(api, done["id"], headers), 30, "the artifacts to expire")
    job = api.get(f"/v1/jobs/{done['id']}", headers=headers).json()
    assert job["expires_at"] == done["expires_at"]
    assert datetime.fromisoformat(job["expires_at"]) <= datetime.now(UTC)
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_server["endpoint"],
        aws_access_key_id=S3_ACCESS,
        aws_secret_access_key=S3_SECRET,
        region_name="us-east-1",
    )
    for folder in ("jobs", "work"):
        listed = s3.list_objects_v2(Bucket=s3_server["bucket"], Prefix=f"artifacts/{folder}/{done['id']}/")
        assert listed.get("KeyCount", 0) == 0, folder
    assert download(artifacts[0]["url"]).status_code == 404  # S3 answers for its own presigned URLs
    response = api.get(f"/v1/jobs/{done['id']}/artifacts", headers=headers)
    assert response.status_code == 410 and response.json()["error"]["code"] == "artifacts_expired"
    assert api.get("/v1/usage", headers=headers).json()["storage_bytes"] == 0


@pytest.fixture
def embedded(pg_database: Callable[[], str], tmp_path: Path) -> Settings:
    database = pg_database()
    upgrade(database)
    return Settings(
        home=tmp_path / "home",
        database_url=database,
        storage_url=f"file://{tmp_path / 'artifacts'}",
        allowed_model_roots=[REPO / "demo"],
        datasets_dir=FIXTURE_DATA,
        auth="none",
        secret_key="test-signing-secret",
        reaper_interval_seconds=0.5,
        default_device="cpu",
    )


def test_expired_artifacts_are_deleted_from_local_storage(embedded: Settings, tmp_path: Path) -> None:
    with TestClient(service_app(embedded)) as api:
        done = succeeded_with_expiry(api, {}, "the embedded job to succeed")
        url = api.get(f"/v1/jobs/{done['id']}/artifacts").json()["data"][0]["url"]
        assert api.get(url).status_code == 200
        folder = tmp_path / "artifacts" / "jobs" / done["id"]
        assert any(folder.iterdir())
        make_storage(embedded).put_work(done["id"], work_file(tmp_path))
        work = tmp_path / "artifacts" / "work" / done["id"]
        assert (work / "recovery-state.pt").read_bytes() == b"training state"

        wait_for(lambda: swept(api, done["id"], {}), 30, "the artifacts to expire")
        assert not folder.exists() and not work.exists()
        assert_gone(api, done, {}, url)
        # Swept once: a later round finds nothing left to do.
        events = api.get(f"/v1/jobs/{done['id']}/events").json()["data"]
        assert sum(e["message"].startswith("artifacts expired") for e in events) == 1


def test_a_delete_expires_the_artifacts_at_once(api: TestClient, distributed_settings: Settings) -> None:
    """A DELETE before the expiry: the 410 gives the time of the DELETE."""
    with session_scope(distributed_settings.database) as session:
        _, key = api_keys.create_api_key(session, "deleter")
        caller = api_keys.Caller(api_keys.find_api_key(session, key).id)  # type: ignore[union-attr]
        fields = {"model": "org/model", "revision": None, "device": "cuda", "queue": "casp-cuda", "config": {}}
        job, _ = jobs.create_job(session, caller, {**fields, "metadata_": {}, "retention_seconds": 3600}, None, "h")
        job_id = job.id
        claimed = job_queue.claim_job(session, job_id, "delete-test")
        assert claimed is not None and job_queue.finish(session, job_id, claimed.attempts, status="succeeded")
    headers = {"Authorization": f"Bearer {key}"}
    promised = datetime.fromisoformat(api.get(f"/v1/jobs/{job_id}", headers=headers).json()["expires_at"])
    assert api.delete(f"/v1/jobs/{job_id}", headers=headers).status_code == 204
    deleted = api.get(f"/v1/jobs/{job_id}", headers=headers).json()
    assert datetime.fromisoformat(deleted["expires_at"]) < promised - timedelta(minutes=59)
    response = api.get(f"/v1/jobs/{job_id}/artifacts", headers=headers)
    assert response.status_code == 410
    stamp = datetime.fromisoformat(deleted["expires_at"]).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert f"expired at {stamp}" in response.json()["error"]["message"]
