"""Keys take turns for the workers (service.job_queue.next_queued, which the embedded workers and, through
fair_turn, the Celery workers claim by), on PostgreSQL."""

from collections.abc import Callable

import pytest

from service import api_keys, job_queue, jobs
from service.db import session_scope
from service.migrate import upgrade

pytestmark = pytest.mark.service

QUEUE = "casp-cpu"


def queue_jobs(database: str, owner: str, count: int, queue: str = QUEUE) -> list[str]:
    fields = {"model": "org/model", "revision": None, "device": "cpu", "queue": queue, "config": {}, "metadata_": {}}
    with session_scope(database) as session:
        return [jobs.create_job(session, api_keys.Caller(owner), fields, None, "hash")[0].id for _ in range(count)]


def run_next(database: str, *, finish: bool = True) -> str | None:
    """Claims what next_queued picks, as a worker does; finished at once unless told to stay running."""
    with session_scope(database) as session:
        job_id = job_queue.next_queued(session, [QUEUE])
        if job_id is None:
            return None
        job = job_queue.claim_job(session, job_id, "fair-test")
        assert job is not None
        if finish:
            assert job_queue.finish(session, job_id, job.attempts, status="succeeded")
        return job.owner_id


@pytest.fixture
def database(pg_database: Callable[[], str]) -> tuple[str, str, str]:
    url = pg_database()
    upgrade(url)
    with session_scope(url) as session:
        alice, _ = api_keys.create_api_key(session, "alice")
        bob, _ = api_keys.create_api_key(session, "bob")
        return url, alice.id, bob.id


def test_a_burst_of_one_key_does_not_starve_another(database: tuple[str, str, str]) -> None:
    url, alice, bob = database
    queue_jobs(url, alice, 4)
    queue_jobs(url, bob, 2)
    queue_jobs(url, bob, 1, queue="casp-cuda")  # another queue: not this worker's to take
    order = [run_next(url) for _ in range(7)]
    assert order == [alice, bob, alice, bob, alice, alice, None]


def test_the_key_with_fewer_running_jobs_goes_first(database: tuple[str, str, str]) -> None:
    url, alice, bob = database
    queue_jobs(url, bob, 1)
    assert run_next(url, finish=False) == bob  # bob's job keeps running
    queue_jobs(url, bob, 1)
    queue_jobs(url, alice, 1)
    # Bob started last and waited longest now, but he has a job running and alice none.
    assert run_next(url, finish=False) == alice
    # Now one running each: bob's last start is the older one.
    queue_jobs(url, alice, 1)
    assert run_next(url) == bob
