"""The service degrades instead of crashing: a database that goes away answers 503 with Retry-After, readiness
checks that storage takes files and has room, and a failed upload leaves no partial artifacts."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import TimeoutError as PoolTimeout

from api.main import create_app
from service import api_keys
from service.db import get_engine, session_scope
from service.migrate import upgrade
from service.settings import Settings
from service.storage import S3Storage, make_storage
from service.tables import Job
from tests.service_fixtures import FIXTURE_DATA, PG_ADMIN_URL, REPO, SMALL_JOB, TINY_JOB
from worker.runner import execute

pytestmark = pytest.mark.service


def embedded_settings(home: Path, **changes: Any) -> Settings:
    values: dict[str, Any] = {
        "home": home,
        "auth": "none",
        "allowed_model_roots": [REPO / "demo"],
        "datasets_dir": FIXTURE_DATA,
        "embedded_workers": 0,
    }
    settings = Settings(**(values | changes))
    upgrade(settings.database)
    return settings


def test_a_database_that_goes_away_answers_503_with_retry_after(pg_database: Callable[[], str], tmp_path: Path) -> None:
    database = pg_database()
    settings = embedded_settings(tmp_path, database_url=database)
    with TestClient(create_app(settings)) as client:
        job = client.post("/v1/jobs", json=SMALL_JOB)
        assert job.status_code == 201
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE "{database.rsplit("/", 1)[1]}" WITH (FORCE)')
        for method, path in (
            ("GET", "/v1/jobs"),
            ("GET", f"/v1/jobs/{job.json()['id']}"),
            ("POST", "/v1/jobs"),
            ("GET", "/metrics"),
        ):
            response = client.request(method, path, json=SMALL_JOB if method == "POST" else None)
            assert response.status_code == 503, (method, path, response.text)
            assert response.headers["Retry-After"] == "5"
            assert response.json()["error"] == {
                "code": "service_unavailable",
                "message": "the database is unreachable; retry later",
                "param": None,
            }
        assert client.get("/healthz").status_code == 200
        ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"


def test_an_exhausted_connection_pool_is_a_503_that_says_so(
    pg_database: Callable[[], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = pg_database()
    settings = embedded_settings(tmp_path, database_url=database)
    engine = get_engine(database)
    # The pool's wait for a free connection (30 s by default), shortened so that the test takes a second.
    monkeypatch.setattr(engine.pool, "_timeout", 0.5)
    held = []
    with pytest.raises(PoolTimeout):
        while True:  # every connection the pool has, overflow included
            held.append(engine.connect())
    with TestClient(create_app(settings)) as client:
        response = client.get("/v1/jobs")
        assert response.status_code == 503 and response.headers["Retry-After"] == "5"
        assert response.json()["error"]["code"] == "database_pool_exhausted"
        assert "every database connection of its pool is in use" in response.json()["error"]["message"]
        for connection in held:
            connection.close()
        assert client.get("/v1/jobs").status_code == 200


def test_readyz_checks_storage_room_and_writability_and_details_need_a_key(tmp_path: Path) -> None:
    settings = embedded_settings(tmp_path, auth="apikey")
    with session_scope(settings.database) as session:
        _, key = api_keys.create_api_key(session, "ops")
    authorized = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").json() == {"ready": True}
        assert client.get("/readyz", headers=authorized).json()["checks"]["storage"] == "ok"

    full = settings.model_copy(update={"ready_min_free_bytes": 1 << 62})
    with TestClient(create_app(full)) as client:
        anonymous = client.get("/readyz")
        detailed = client.get("/readyz", headers=authorized)
    # Without a key: only that it is not ready; with one, why.
    assert anonymous.status_code == 503 and anonymous.json() == {
        "error": {"code": "not_ready", "message": "not ready", "param": None}
    }
    assert detailed.status_code == 503
    reasons = detailed.json()["error"]["message"]
    assert reasons.startswith("not ready: storage: ") and "below CASP_READY_MIN_FREE_BYTES" in reasons
    assert "database" not in reasons

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    unwritable = settings.model_copy(update={"storage_url": f"file://{blocker}/artifacts"})
    with TestClient(create_app(unwritable)) as client:
        detailed = client.get("/readyz", headers=authorized)
    assert detailed.status_code == 503 and "storage: NotADirectoryError" in detailed.json()["error"]["message"]


def failing_on_put(storage: S3Storage, nth: int) -> list[str]:
    """Makes the real S3 client fail its `nth` PutObject, as a server dropping out mid-upload would; returns
    the keys of the puts that went through."""
    put: list[str] = []

    def before_put(params: dict[str, Any], **_: Any) -> None:
        if len(put) + 1 == nth:
            raise ConnectionError("the S3 server went away")
        put.append(params["Key"])

    storage.client.meta.events.register("before-parameter-build.s3.PutObject", before_put)
    return put


def test_a_failed_upload_leaves_no_partial_artifacts(
    api: TestClient, keys: dict[str, dict[str, str]], distributed_settings: Settings
) -> None:
    job_id = api.post("/v1/jobs", json={**TINY_JOB, "device": "cuda"}, headers=keys["alice"]).json()["id"]
    with session_scope(distributed_settings.database) as session:
        session.get_one(Job, job_id).device = "cpu"  # parked on the cuda queue, run here by hand on the CPU
    storage = make_storage(distributed_settings)
    assert isinstance(storage, S3Storage)
    uploaded = failing_on_put(storage, nth=3)
    assert execute(job_id, distributed_settings, storage, worker_id="upload-fails") == "failed"
    assert len(uploaded) == 2  # two files went up before the failure

    job = api.get(f"/v1/jobs/{job_id}", headers=keys["alice"]).json()
    assert job["error"]["code"] == "upload_failed" and "the S3 server went away" in job["error"]["message"]
    assert api.get(f"/v1/jobs/{job_id}/artifacts", headers=keys["alice"]).status_code == 409
    listing = storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=storage.key(job_id) + "/")
    assert listing.get("Contents", []) == []
