"""bench/load.py in a tiny mode against the distributed stack (PostgreSQL and Redis)."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import load
from tests.service_fixtures import PG_ADMIN_URL, RedisServer, free_port

pytestmark = pytest.mark.service


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[str]:
    """A Redis server of the test's own: the bench empties its database, which must not be one the session's
    worker and API use."""
    server = RedisServer(free_port(), tmp_path / "redis.log")
    server.start()
    try:
        yield f"redis://127.0.0.1:{server.port}/0"
    finally:
        server.stop()


@pytest.mark.slow
def test_load_bench_distributed_tiny(local_services: None, own_redis: str, tmp_path: Path) -> None:
    load.main(
        ["--modes", "distributed", "--jobs", "6", "--polls", "10", "--concurrency", "2", "--out", str(tmp_path),
         "--pg-admin-url", PG_ADMIN_URL, "--redis-url", own_redis, "--streams", "30", "--stream-jobs", "5",
         "--stream-rounds", "2"]
    )  # fmt: skip
    distributed = json.loads((tmp_path / "load.json").read_text())["modes"]["distributed"]
    assert (distributed["database"], distributed["broker"]) == ("postgresql", "redis")
    assert distributed["submit_cancel"]["errors"] == 0 and distributed["status"]["errors"] == 0
    assert distributed["submit_cancel"]["statuses_after_cancel"] == {"cancelled": 6}
    streams = distributed["event_streams"]
    assert streams["opened"] == 30 and streams["over_cap_status"] == 429
    assert streams["events"] == 10 and streams["delivered"] == streams["deliveries_expected"] == 60
    assert streams["server_errors"] == 0 and streams["errors"] == 0
