"""Per-key limits hold under a burst of simultaneous submissions, on SQLite (the embedded mode) and on
PostgreSQL: a real server, twelve requests released together. (On SQLite the limits were counted outside the
write transaction, and all twelve got 201 against a limit of 3.)"""

import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.main import create_app
from service import api_keys
from service.db import session_scope
from tests.service_fixtures import SMALL_JOB, embedded_settings, serving

pytestmark = pytest.mark.service

BURST = 12


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """None: the embedded mode's SQLite file; else a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return None
    make: Callable[[], str] = request.getfixturevalue("pg_database")
    return make()


def burst(url: str, key: str) -> list[httpx.Response]:
    """BURST submissions from as many threads, each with its connection open, sent at the same moment."""
    clients = [httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) for _ in range(BURST)]
    for client in clients:  # connected before the start, so the requests leave together
        assert client.get("/healthz").status_code == 200
    start = threading.Barrier(BURST)

    def submit(client: httpx.Client) -> httpx.Response:
        start.wait()
        return client.post("/v1/jobs", json=SMALL_JOB)  # stays queued: no worker threads

    try:
        with ThreadPoolExecutor(BURST) as pool:
            return list(pool.map(submit, clients))
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize(
    ("limits", "allowed", "code"),
    [
        ({"max_active_jobs": 3}, 3, "max_active_jobs_exceeded"),
        ({"max_submissions_per_minute": 5}, 5, "max_submissions_per_minute_exceeded"),
    ],
)
def test_a_burst_of_submissions_does_not_overshoot_a_limit(
    database: str | None, tmp_path: Path, limits: dict[str, int], allowed: int, code: str
) -> None:
    changes: dict[str, Any] = {"auth": "apikey", "default_device": "cpu"}
    if database:
        changes["database_url"] = database
    settings = embedded_settings(tmp_path, **changes)
    with session_scope(settings.database) as session:
        _, key = api_keys.create_api_key(session, "burst", **limits)
    with serving(create_app(settings)) as url:
        responses = burst(url, key)
        statuses = Counter(response.status_code for response in responses)
        assert statuses == {201: allowed, 429: BURST - allowed}, [r.text for r in responses]
        assert {r.json()["error"]["code"] for r in responses if r.status_code == 429} == {code}
        usage = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert usage["active_jobs"] == usage["submissions_last_minute"] == allowed
