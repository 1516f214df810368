"""Draining a worker (docs/operations.md): SIGTERM to the worker's main process, as `docker stop` sends it, lets
the running job finish and takes no new one. A private redis-server and worker, so no other worker takes jobs."""

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from casp_cli.app import service_app
from service.dispatch import CeleryDispatcher
from service.migrate import upgrade
from tests.service_fixtures import (
    SMALL_JOB,
    TINY_JOB,
    RedisServer,
    WorkerProcess,
    free_port,
    private_broker_settings,
    settings_env,
    wait_for,
)

pytestmark = pytest.mark.service

# Long enough on a CPU (about ten seconds) to be sure the job is mid-run when the signal comes.
LONG_JOB = {**SMALL_JOB, "calibration": {"dataset": "wikitext2:validation", "n_samples": 64, "seq_len": 256}}


@pytest.mark.slow
def test_sigterm_drains_a_worker_the_running_job_finishes_and_the_next_stays_queued(
    pg_database: Callable[[], str], tmp_path: Path, local_services: None
) -> None:
    server = RedisServer(free_port(), tmp_path / "redis.log")
    server.start()
    database = pg_database()
    upgrade(database)
    settings = private_broker_settings(tmp_path, database, server, default_device="cpu")
    worker = WorkerProcess(settings_env(settings), tmp_path / "worker.log")
    worker.start()
    try:
        with TestClient(service_app(settings)) as api:
            running = api.post("/v1/jobs", json=LONG_JOB).json()["id"]
            wait_for(lambda: api.get(f"/v1/jobs/{running}").json()["stage"] is not None, 120, "the job to start")
            assert worker.process is not None
            os.kill(worker.process.pid, signal.SIGTERM)  # the main process only, as `docker stop` does
            waiting = api.post("/v1/jobs", json=TINY_JOB).json()["id"]

            def ended() -> dict[str, Any] | None:
                job = api.get(f"/v1/jobs/{running}").json()
                return job if job["status"] != "running" else None

            done = wait_for(ended, 240, "the running job to end")
            assert done["status"] == "succeeded" and done["attempts"] == 1, (done, worker.log_tail())
            assert worker.process.wait(60) == 0, worker.log_tail()
            # The worker left the next job alone: queued, never claimed, its message still in the broker.
            queued = api.get(f"/v1/jobs/{waiting}").json()
            assert queued["status"] == "queued" and queued["attempts"] == 0
            assert CeleryDispatcher(settings).depth()["casp-cpu"] == 1
    finally:
        worker.stop()
        server.stop()
