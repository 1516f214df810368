"""What docs/operations.md promises an operator, against PostgreSQL and Redis: `casp serve`'s JSON request
lines name the job and the key, `casp keys revoke` stops a key at once, and links signed with a previous
URL secret keep working until they expire."""

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.main import create_app
from service import api_keys, jobs
from service.db import session_scope
from service.security import sign_download
from service.settings import Settings
from service.storage import make_storage
from service.tables import ApiKey, Artifact, Job
from tests.service_fixtures import REPO, TINY_JOB, free_port, settings_env, wait_for

pytestmark = pytest.mark.service

PARKED = {**TINY_JOB, "device": "cuda"}  # no test worker reads the cuda queue: the job stays queued


@pytest.fixture
def served(distributed_settings: Settings, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`casp serve` as docker-compose runs it (CASP_LOG_FORMAT=json); (its URL, its log file)."""
    port, log_path = free_port(), tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "casp_cli.main", "serve", "--port", str(port)],
            cwd=REPO,
            env=settings_env(distributed_settings),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, log_path.read_text()
        try:
            return httpx.get(f"{url}/healthz").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 60, "casp serve")
        yield url, log_path
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


@pytest.mark.slow
def test_casp_serve_writes_json_lines_whose_requests_name_the_job_and_the_key(
    served: tuple[str, Path], keys: dict[str, dict[str, str]]
) -> None:
    url, log_path = served
    with httpx.Client(base_url=url, headers=keys["bob"]) as client:
        created = client.post("/v1/jobs", json=PARKED)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        assert client.get(f"/v1/jobs/{job_id}").status_code == 200
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        assert client.get("/v1/jobs").status_code == 200

    def access_lines() -> dict[str, dict[str, Any]] | None:
        """Each request's access record by its request line, once the last request's is written."""
        records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        lines = {r["message"].split('"')[1]: r for r in records if r["logger"] == "uvicorn.access"}
        return lines if "GET /v1/jobs HTTP/1.1" in lines else None

    by_request = wait_for(access_lines, 10, "the access lines")
    assert set(by_request) >= {"POST /v1/jobs HTTP/1.1", f"GET /v1/jobs/{job_id} HTTP/1.1", "GET /v1/jobs HTTP/1.1"}
    for request in (
        "POST /v1/jobs HTTP/1.1",
        f"GET /v1/jobs/{job_id} HTTP/1.1",
        f"POST /v1/jobs/{job_id}/cancel HTTP/1.1",
    ):
        assert by_request[request]["job_id"] == job_id, request
        assert by_request[request]["key_name"] == "bob", request
    # A request about no job carries the key only; one without a key, neither.
    assert (
        "job_id" not in by_request["GET /v1/jobs HTTP/1.1"] and by_request["GET /v1/jobs HTTP/1.1"]["key_name"] == "bob"
    )
    assert {"job_id", "key_name"}.isdisjoint(by_request["GET /healthz HTTP/1.1"])


def casp(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "casp_cli.main", *args],
        cwd=REPO,
        env=settings_env(settings),
        capture_output=True,
        text=True,
    )


def test_keys_revoke_stops_a_key_at_once_and_keeps_its_jobs(api: TestClient, distributed_settings: Settings) -> None:
    with session_scope(distributed_settings.database) as session:
        row, key = api_keys.create_api_key(session, "dave")
        key_id = row.id
    headers = {"Authorization": f"Bearer {key}"}
    job = api.post("/v1/jobs", json=PARKED, headers=headers).json()
    assert api.post(f"/v1/jobs/{job['id']}/cancel", headers=headers).status_code == 200

    revoked = casp(distributed_settings, "keys", "revoke", key_id)
    assert revoked.returncode == 0 and f"revoked key {key_id} (dave)" in revoked.stderr, revoked.stderr
    assert api.get("/v1/jobs", headers=headers).status_code == 401
    listed = casp(distributed_settings, "keys", "list")
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[1] for line in listed.stdout.splitlines() if line.startswith(key_id)] == ["revoked"]
    with session_scope(distributed_settings.database) as session:
        assert session.get_one(Job, job["id"]).owner_id == key_id
        assert session.get_one(ApiKey, key_id).name == "dave"
    # Again: nothing changes; an unknown id is one line and exit 1.
    assert casp(distributed_settings, "keys", "revoke", key_id).returncode == 0
    unknown = casp(distributed_settings, "keys", "revoke", "0" * 32)
    assert unknown.returncode == 1
    assert unknown.stderr.strip().splitlines() == [
        f"casp: error: not_found: no API key with id {'0' * 32} (see casp keys list)"
    ]


def local_settings(settings: Settings, root: Path, secret: str, previous: list[str]) -> Settings:
    # Built anew, not copied: a copy would keep the signing key cached on the original.
    fields = settings.model_dump() | {"storage_url": f"file://{root}", "secret_key": secret}
    return Settings(**fields | {"previous_secret_keys": previous})


def test_links_signed_with_a_previous_secret_work_until_they_expire(
    distributed_settings: Settings, tmp_path: Path
) -> None:
    before = local_settings(distributed_settings, tmp_path, "old-secret", [])
    rotated = local_settings(distributed_settings, tmp_path, "new-secret", ["older-secret", "old-secret"])
    forgotten = local_settings(distributed_settings, tmp_path, "new-secret", [])
    with session_scope(distributed_settings.database) as session:
        job, _ = jobs.create_job(
            session,
            api_keys.Caller(None),
            {"model": "m", "device": "cpu", "queue": "casp-cpu", "config": {}},
            None,
            "-",
        )
        session.execute(update(Job).where(Job.id == job.id).values(status="succeeded"))
        session.add(Artifact(job_id=job.id, name="report.md", size=5, sha256="-"))
        job_id = job.id
    path = make_storage(before).path(job_id, "report.md")
    path.parent.mkdir(parents=True)
    path.write_text("hello")

    issued = make_storage(before).url(job_id, "report.md", 600, "")  # handed out before the rotation
    expires, signature = sign_download(b"old-secret", job_id, "report.md", -1)
    expired = f"/v1/files/{job_id}/report.md?expires={expires}&signature={signature}"
    new = make_storage(rotated).url(job_id, "report.md", 600, "")
    assert "signature=" in new and new != issued
    with TestClient(create_app(rotated)) as client:
        assert client.get(issued).text == "hello"
        assert client.get(new).text == "hello"
        assert client.get(expired).status_code == 403
    with TestClient(create_app(forgotten)) as client:
        assert client.get(issued).status_code == 403
        assert client.get(new).text == "hello"
