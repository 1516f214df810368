"""Every queued job reaches a worker: sends that failed and messages the broker lost are sent again, stale
messages cost nothing. Against a private redis-server (stopped and restarted here), PostgreSQL, a real
worker process and the API with its reaper."""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from casp_cli.app import service_app
from service import job_queue, jobs
from service.db import session_scope
from service.dispatch import CeleryDispatcher
from service.migrate import upgrade
from service.reaper import LOST_MESSAGE, reap_once
from service.settings import Settings
from service.tables import Job, utcnow
from tests.service_fixtures import (
    SMALL_JOB,
    TINY_JOB,
    RedisServer,
    WorkerProcess,
    finished,
    free_port,
    private_broker_settings,
    settings_env,
    wait_for,
)

pytestmark = pytest.mark.service

PARKED = {**SMALL_JOB, "device": "cuda"}  # no worker here reads the cuda queue


@dataclass
class Stack:
    settings: Settings
    redis: RedisServer
    worker: WorkerProcess
    api: TestClient

    def job(self, job_id: str) -> dict[str, Any]:
        return self.api.get(f"/v1/jobs/{job_id}").json()

    def messages(self, job_id: str) -> list[str]:
        return [e["message"] for e in self.api.get(f"/v1/jobs/{job_id}/events").json()["data"]]

    def wait_job(self, job_id: str, until: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        def poll() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if until(job) else None

        return wait_for(poll, 240, what, interval=0.25)


@pytest.fixture(scope="module")
def stack(
    pg_database: Callable[[], str], tmp_path_factory: pytest.TempPathFactory, local_services: None
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("dispatch")
    server = RedisServer(free_port(), root / "redis.log")
    server.start()
    database = pg_database()
    upgrade(database)
    settings = private_broker_settings(
        root,
        database,
        server,
        heartbeat_interval_seconds=1.0,
        heartbeat_timeout_seconds=6.0,
        reaper_interval_seconds=1.0,
        default_device="auto",
    )
    worker = WorkerProcess(settings_env(settings), root / "worker.log")
    worker.start()
    try:
        with TestClient(service_app(settings)) as api:
            yield Stack(settings, server, worker, api)
    finally:
        worker.stop()
        server.stop()


def test_stale_messages_of_cancelled_jobs_are_dropped_without_holding_the_queue(stack: Stack) -> None:
    ids = [stack.api.post("/v1/jobs", json=PARKED).json()["id"] for _ in range(20)]
    for job_id in ids:
        assert stack.api.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    dispatcher = CeleryDispatcher(stack.settings)
    started = time.monotonic()
    for job_id in ids:  # the messages a cancelled job leaves in the queue its worker reads
        dispatcher.enqueue(job_id, "casp-cpu")
    wait_for(
        lambda: all(f"job {job_id} is not queued" in stack.worker.log_tail() for job_id in ids[-3:]),
        60,
        "the stale messages to drain",
        interval=0.05,
    )
    # Dropped in the worker's main process, a database read each: not a fresh pool child each (~0.7 s).
    assert time.monotonic() - started < 5, stack.worker.log_tail()
    assert redis.Redis.from_url(stack.settings.broker_url).llen("casp-cpu") == 0
    assert all(stack.job(job_id)["attempts"] == 0 for job_id in ids)


def test_a_requeued_job_whose_send_failed_is_sent_when_the_broker_is_back(stack: Stack) -> None:
    """The reaper queues a job again while the broker is down: the job must not stay queued without a
    message. It is sent once the broker answers, exactly once, and stays so while it waits its turn."""
    job_id = stack.api.post("/v1/jobs", json=PARKED).json()["id"]
    queue = redis.Redis.from_url(stack.settings.broker_url)
    queue.delete("casp-cuda")
    database = stack.settings.database
    with session_scope(database) as session:
        claimed = job_queue.claim_job(session, job_id, "doomed-worker")
        assert claimed is not None
        claimed.stage, claimed.progress = "pruning", 42.0
        # Stale for a reaper with a 1 s timeout, not yet for the API's own (6 s): this one reaps it.
        claimed.heartbeat_at = utcnow() - timedelta(seconds=2)
    down = stack.settings.model_copy(
        update={"broker_url": f"redis://127.0.0.1:{free_port()}/0", "heartbeat_timeout_seconds": 1.0}
    )
    reaped = reap_once(down, CeleryDispatcher(down))
    assert [job for job, _, _ in reaped.requeued] == [job_id]

    job = stack.job(job_id)
    # Where it restarts from: the beginning, and the event says why.
    assert (job["status"], job["stage"], job["progress"]) == ("queued", None, 0)
    messages = stack.messages(job_id)
    assert any(m.startswith("worker lost; queued again, to start over") and "pruning at 42 %" in m for m in messages)
    assert any("the broker is unreachable" in m for m in messages)
    # The API's own reaper (whose broker is up) sends it.
    wait_for(lambda: queue.llen("casp-cuda") == 1, 30, "the job to be sent again")
    assert CeleryDispatcher(stack.settings).held_job_ids() >= {job_id}
    # Waiting its turn behind others, it is not sent again: the message is still there.
    time.sleep(4 * stack.settings.reaper_interval_seconds)
    assert queue.llen("casp-cuda") == 1
    assert LOST_MESSAGE not in stack.messages(job_id)
    stack.api.post(f"/v1/jobs/{job_id}/cancel")


@pytest.mark.slow
def test_every_job_ends_once_across_a_broker_restart(stack: Stack) -> None:
    """Redis stops while one job runs and others wait in its queue, and comes back empty (no persistence):
    every job still runs, exactly once, to success."""
    ids = [stack.api.post("/v1/jobs", json=TINY_JOB).json()["id"] for _ in range(2)]
    first = stack.job(ids[0])
    assert first["device"] == "auto"
    with session_scope(stack.settings.database) as session:
        assert session.get_one(Job, ids[0]).queue == "casp-auto"
    stack.wait_job(ids[0], lambda job: job["status"] == "running" and job["stage"] is not None, "a job to run")

    stack.redis.stop()
    # Submitted while the broker is down: accepted, and kept queued until it can be sent.
    during = stack.api.post("/v1/jobs", json=TINY_JOB)
    assert during.status_code == 201 and during.json()["status"] == "queued"
    ids.append(during.json()["id"])
    assert any("the broker is unreachable" in m for m in stack.messages(ids[-1]))
    time.sleep(2)
    stack.redis.start()  # empty: the waiting messages are gone

    done = [stack.wait_job(job_id, finished, f"job {job_id} to finish") for job_id in ids]
    assert [job["status"] for job in done] == ["succeeded"] * len(ids), (done, stack.worker.log_tail())
    for job in done:
        messages = stack.messages(job["id"])
        # One attempt, one run, one success: no job ran twice.
        assert job["attempts"] == 1, messages
        assert sum(m.startswith("running on ") for m in messages) == 1, messages
        assert messages.count("succeeded") == 1, messages
    # The job that was waiting in the queue when it emptied was found lost and sent again.
    assert LOST_MESSAGE in stack.messages(ids[1])
    with session_scope(stack.settings.database) as session:
        for job_id in ids:
            names = [a.name for a in jobs.artifacts_of(session, job_id)]
            assert "model.safetensors" in names and len(names) == len(set(names))
