"""bench/load.py in a tiny mode against the distributed stack (PostgreSQL and Redis)."""

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bench import load
from tests.service_fixtures import PG_ADMIN_URL, free_port, wait_for

pytestmark = pytest.mark.service


@pytest.fixture
def own_redis() -> Iterator[str]:
    """A Redis server of the test's own: the bench empties its database, which must not be one the session's
    worker and API use."""
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for(lambda: _answers(url), 30, "the test's redis-server")
        yield url
    finally:
        process.terminate()
        process.wait(30)


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.ConnectionError:
        return False


def test_load_bench_distributed_tiny(local_services: None, own_redis: str, tmp_path: Path) -> None:
    load.main(
        ["--modes", "distributed", "--jobs", "6", "--polls", "10", "--concurrency", "2", "--out", str(tmp_path),
         "--pg-admin-url", PG_ADMIN_URL, "--redis-url", own_redis]
    )  # fmt: skip
    distributed = json.loads((tmp_path / "load.json").read_text())["modes"]["distributed"]
    assert (distributed["database"], distributed["broker"]) == ("postgresql", "redis")
    assert distributed["submit_cancel"]["errors"] == 0 and distributed["status"]["errors"] == 0
    assert distributed["submit_cancel"]["statuses_after_cancel"] == {"cancelled": 6}
