"""A job's end posted to its webhook: a local HTTP receiver checks the signature, and fails the first attempts to
see the retries, each an event; against PostgreSQL and Redis with the API's notifier thread."""

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fastapi.testclient import TestClient
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from casp_cli.app import service_app
from service import job_queue
from service.db import session_scope
from service.settings import Settings
from service.tables import StageDelivery
from tests.api.test_api import PARKED, refusal
from tests.service_fixtures import REPO, TINY_JOB, WorkerProcess, finished, wait_for, wait_job

pytestmark = pytest.mark.service

# CASP_WEBHOOK_SECRET's two forms. The Standard Webhooks one (the specification's example secret), which a
# receiver's library takes as it is; and a raw string, whose UTF-8 bytes are the key: such a receiver's library takes
# those bytes (this one is not the whsec_ form: a hyphen, not an underscore).
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
RAW_SECRET = "whsec-test"


@dataclass
class Receiver:
    """Answers 500 to the first `failures` requests, then 200, each after `delay` seconds; keeps what it received
    and when."""

    failures: int = 0
    delay: float = 0.0
    received: list[tuple[float, dict[str, str], bytes]] = field(default_factory=list)
    url: str = ""


@contextlib.contextmanager
def serving() -> Iterator[Receiver]:
    """A Receiver on a free local port, in a thread of its own."""
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.received.append((time.monotonic(), dict(self.headers), body))
            time.sleep(state.delay)
            self.send_response(500 if len(state.received) <= state.failures else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            """Quiet."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/casp"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with serving() as state:
        yield state


@pytest.fixture
def hooked(distributed_settings: Settings) -> Settings:
    return distributed_settings.model_copy(
        update={
            "webhook_secret": SECRET,
            "webhook_allowed_hosts": ["127.0.0.1", "localhost"],
            "webhook_allow_private": True,
            "webhook_backoff_seconds": 0.3,
            "webhook_poll_seconds": 0.2,
            "webhook_max_attempts": 3,
            "auth": "none",
        }
    )


def documented_receiver() -> Callable[[str, dict[str, str], bytes], bool]:
    """The receiver docs/service.md shows (standard library only), run as it is written there."""
    text = (REPO / "docs" / "service.md").read_text()
    code = re.search(r"```python\n(# A receiver of casp's webhooks.*?)```", text, re.S)
    assert code, "docs/service.md has no webhook receiver example"
    namespace: dict[str, Any] = {}
    exec(code.group(1), namespace)
    return namespace["verified"]


def webhook_events(api: TestClient, job_id: str) -> list[str]:
    events = api.get(f"/v1/jobs/{job_id}/events").json()["data"]
    return [e["message"] for e in events if e["kind"] == "webhook"]


@pytest.mark.parametrize(
    ("secret", "library_secret", "form"),
    [
        (SECRET, SECRET, "a Standard Webhooks whsec_ key"),
        (RAW_SECRET, RAW_SECRET.encode(), "a raw string"),
    ],
    ids=["whsec", "raw"],
)
def test_the_end_of_a_job_is_posted_signed_and_retried(
    hooked: Settings,
    receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
    secret: str,
    library_secret: str | bytes,
    form: str,
) -> None:
    """`library_secret`: what a receiver gives its Standard Webhooks library for this CASP_WEBHOOK_SECRET."""
    receiver.failures = 2
    caplog.set_level(logging.INFO, logger="service.webhooks")
    with TestClient(service_app(hooked.model_copy(update={"webhook_secret": secret}))) as api:
        job = api.post("/v1/jobs", json={**PARKED, "webhook_url": receiver.url}).json()
        assert (job["webhook_url"], job["webhook_state"]) == (receiver.url, "pending")
        api.post(f"/v1/jobs/{job['id']}/cancel")
        done = wait_for(
            lambda: (j := api.get(f"/v1/jobs/{job['id']}").json())["webhook_state"] == "delivered" and j,
            30,
            "the webhook to be delivered",
        )
        assert webhook_events(api, job["id"]) == [
            "failed: HTTP 500 (attempt 1)",
            "failed: HTTP 500 (attempt 2)",
            "delivered: HTTP 200 (attempt 3)",
        ]
    assert len(receiver.received) == 3
    # The notifier says at start how it reads the secret, and never shows it.
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("webhooks on;")]
    assert len(started) == 1 and started[0].startswith(f"webhooks on; CASP_WEBHOOK_SECRET read as {form}"), started
    assert all(secret not in r.getMessage() for r in caplog.records)
    # Waits that double: 0.3 s, then 0.6 s.
    times = [at for at, _, _ in receiver.received]
    assert times[1] - times[0] >= 0.3 and times[2] - times[1] >= 0.6
    verified = documented_receiver()
    for _, headers, body in receiver.received:
        assert headers["Casp-Event"] == "job.cancelled" and headers["Content-Type"] == "application/json"
        # Standard Webhooks: the specification's reference verifier takes it, and the documented receiver too; the
        # id is the same on every attempt, so a receiver can drop a repeat.
        assert headers["webhook-id"] == f"{job['id']}.job.cancelled"
        assert Webhook(library_secret).verify(body, headers)["id"] == job["id"]
        assert verified(secret, headers, body)
        tampered = body.replace(b'"cancelled"', b'"succeeded"', 1)
        assert tampered != body
        with pytest.raises(WebhookVerificationError):
            Webhook(library_secret).verify(tampered, headers)
        assert not verified(secret, headers, tampered)
        with pytest.raises(WebhookVerificationError):
            Webhook(b"another secret").verify(body, headers)
        assert not verified("another secret", headers, body)
        # casp's own header of the release before is gone, as its release note said.
        assert "casp-signature" not in {name.lower() for name in headers}
        posted = json.loads(body)
        assert posted["id"] == job["id"] and posted["status"] == "cancelled"
    assert done["status"] == "cancelled"


def webhook_failures_metric(api: TestClient) -> float:
    lines = api.get("/metrics").text.splitlines()
    return next(float(line.split()[1]) for line in lines if line.startswith("casp_webhook_failures_total "))


def test_a_webhook_that_keeps_failing_ends_failed_after_the_last_attempt(hooked: Settings, receiver: Receiver) -> None:
    receiver.failures = 100
    with TestClient(service_app(hooked.model_copy(update={"webhook_max_attempts": 2}))) as api:
        failures_before = webhook_failures_metric(api)
        job = api.post("/v1/jobs", json={**PARKED, "webhook_url": receiver.url}).json()
        api.post(f"/v1/jobs/{job['id']}/cancel")
        wait_for(lambda: api.get(f"/v1/jobs/{job['id']}").json()["webhook_state"] == "failed", 30, "it to fail")
        time.sleep(1)  # nothing more is sent after the last attempt
        assert webhook_events(api, job["id"]) == ["failed: HTTP 500 (attempt 1)", "failed: HTTP 500 (attempt 2)"]
        # Each failed attempt counts in the metric operators alert on (docs/operations.md).
        assert webhook_failures_metric(api) == failures_before + 2
    assert len(receiver.received) == 2


def test_a_receiver_that_hangs_holds_back_its_own_jobs_deliveries_and_no_other_jobs(
    hooked: Settings, receiver: Receiver
) -> None:
    timing_out = hooked.model_copy(update={"webhook_timeout_seconds": 2.0, "webhook_max_attempts": 2})
    with serving() as slow_receiver, TestClient(service_app(timing_out)) as api:
        slow_receiver.delay = 5.0  # longer than the timeout: every attempt times out
        stuck = api.post("/v1/jobs", json={**PARKED, "webhook_url": slow_receiver.url}).json()
        api.post(f"/v1/jobs/{stuck['id']}/cancel")
        wait_for(lambda: slow_receiver.received, 30, "the stuck job's first attempt")
        fine = api.post("/v1/jobs", json={**PARKED, "webhook_url": receiver.url}).json()
        api.post(f"/v1/jobs/{fine['id']}/cancel")
        wait_for(lambda: api.get(f"/v1/jobs/{fine['id']}").json()["webhook_state"] == "delivered", 30, "delivered")
        # Delivered while the other job's attempts still time out, one after another.
        assert api.get(f"/v1/jobs/{stuck['id']}").json()["webhook_state"] == "pending"
        wait_for(lambda: api.get(f"/v1/jobs/{stuck['id']}").json()["webhook_state"] == "failed", 30, "it to fail")
        assert webhook_events(api, stuck["id"]) == [
            "failed: ReadTimeout: timed out (attempt 1)",
            "failed: ReadTimeout: timed out (attempt 2)",
        ]


def test_webhook_urls_are_checked_at_submit(hooked: Settings, receiver: Receiver) -> None:
    private_refused = hooked.model_copy(update={"webhook_allow_private": False})
    off = hooked.model_copy(update={"webhook_secret": None})
    cases = [
        (hooked, "https://hooks.example.org/x", "not one of CASP_WEBHOOK_ALLOWED_HOSTS"),
        (hooked, "ftp://127.0.0.1/x", "http:// or https://"),
        (private_refused, "http://localhost:9/x", "not a public address"),
        (off, receiver.url, "webhooks are off on this server"),
    ]
    for settings, url, reason in cases:
        with TestClient(service_app(settings)) as api:
            error = refusal(api.post("/v1/jobs", json={**PARKED, "webhook_url": url}))
        assert error["param"] == "webhook_url" and reason in error["message"], (url, error)


def stages_started(api: TestClient, job_id: str) -> list[str]:
    """The stages the job's first attempt started, in order, as its progress events show them: the worker writes
    those with the stage it starts. Another kind of event names the stage its writer read, which the worker may
    have left by the time it is written (a webhook event written as the next stage starts)."""
    stages: list[str] = []
    events = api.get(f"/v1/jobs/{job_id}/events").json()
    assert not events["has_more"]
    for event in events["data"]:
        if event["kind"] != "progress" or event["attempt"] != 1:
            continue
        if not stages or stages[-1] != event["stage"]:
            stages.append(event["stage"])
    return stages


def test_job_stage_posts_each_stage_started_and_the_events_a_job_names_are_all_it_gets(
    hooked: Settings, receiver: Receiver, worker: WorkerProcess
) -> None:
    receiver.failures = 1  # the first stage's delivery is tried again
    job_request = {
        **TINY_JOB,
        "device": "cpu",
        "webhook_url": receiver.url,
        "webhook_events": ["job.stage", "job.failed"],
    }
    with TestClient(service_app(hooked)) as api:
        created = api.post("/v1/jobs", json=job_request)
        assert created.status_code == 201, created.text
        job = created.json()
        assert job["webhook_events"] == ["job.stage", "job.failed"]
        done = wait_job(api, job["id"], {}, finished, "the job to finish")
        assert done["status"] == "succeeded", done["error"]
        stages = stages_started(api, job["id"])
        assert len(stages) >= 4 and stages[0] == "load", stages
        # It succeeded, which its events leave out: nothing is posted for its end.
        wait_for(lambda: api.get(f"/v1/jobs/{job['id']}").json()["webhook_state"] == "skipped", 30, "the end skipped")
        wait_for(lambda: len(receiver.received) >= len(stages) + 1, 90, "a delivery per stage")
        messages = webhook_events(api, job["id"])
        # The defaults: the three final events, for a job that names none.
        plain = api.post("/v1/jobs", json={**PARKED, "webhook_url": receiver.url}).json()
        assert plain["webhook_events"] == ["job.succeeded", "job.failed", "job.cancelled"]
        api.post(f"/v1/jobs/{plain['id']}/cancel")
    time.sleep(1)  # nothing more comes
    assert messages[:2] == [
        f"failed: HTTP 500 (job.stage {stages[0]}, attempt 1)",
        f"delivered: HTTP 200 (job.stage {stages[0]}, attempt 2)",
    ]
    assert messages[2:] == [f"delivered: HTTP 200 (job.stage {stage}, attempt 1)" for stage in stages[1:]]
    # The plain job's cancellation may be delivered to the same receiver before the client closes: it is its own.
    ours = [entry for entry in receiver.received if entry[1]["webhook-id"].startswith(f"{job['id']}.")]
    theirs = [entry[1]["webhook-id"] for entry in receiver.received if entry not in ours]
    assert theirs in ([], [f"{plain['id']}.job.cancelled"]), theirs
    posted = []
    verified = documented_receiver()
    for _, headers, body in ours[1:]:  # the first answered 500
        assert headers["Casp-Event"] == "job.stage"
        payload = Webhook(SECRET).verify(body, headers)
        assert verified(SECRET, headers, body)
        assert headers["webhook-id"] == f"{job['id']}.job.stage.1.{payload['stage']}"
        assert (payload["type"], payload["job_id"], payload["attempt"]) == ("job.stage", job["id"], 1)
        posted.append(payload["stage"])
    assert posted == stages
    assert ours[0][2] == ours[1][2]  # the retry posts the same body


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"webhook_events": ["job.stage"]}, "only goes with a `webhook_url`"),
        ({"webhook_url": "http://127.0.0.1:9/x", "webhook_events": ["job.started"]}, "'job.stage'"),
        ({"webhook_url": "http://127.0.0.1:9/x", "webhook_events": ["job.stage", "job.stage"]}, "names an event twice"),
        ({"webhook_url": "http://127.0.0.1:9/x", "webhook_events": []}, "at least 1 item"),
    ],
)
def test_webhook_events_are_checked_at_submit(hooked: Settings, change: dict[str, Any], reason: str) -> None:
    with TestClient(service_app(hooked)) as api:
        error = refusal(api.post("/v1/jobs", json={**PARKED, **change}))
    assert error["param"].startswith("webhook_events") and reason in error["message"], error


def test_a_stage_delivery_is_written_once_per_stage_started_and_only_for_jobs_that_ask(
    hooked: Settings, receiver: Receiver
) -> None:
    quiet = hooked.model_copy(update={"webhook_poll_seconds": 3600.0})  # nothing delivered: the rows are looked at
    with TestClient(service_app(quiet)) as api:
        asks, plain, no_hook = (
            api.post("/v1/jobs", json={**PARKED, **extra}).json()["id"]
            for extra in (
                {"webhook_url": receiver.url, "webhook_events": ["job.stage"]},
                {"webhook_url": receiver.url},
                {},
            )
        )
    for job_id in (asks, plain, no_hook):
        with session_scope(quiet.database) as session:
            attempt = job_queue.claim_job(session, job_id, "by-hand")
            assert attempt is not None
            for stage in ("load", "load", "calibrate", "calibrate", "prune"):  # progress within a stage repeats it
                assert job_queue.touch(session, job_id, attempt.attempts, stage=stage, progress=1.0)
    with session_scope(quiet.database) as session:
        written = session.query(StageDelivery).filter(StageDelivery.job_id.in_([asks, plain, no_hook])).all()
        assert sorted((row.job_id, row.attempt, row.stage) for row in written) == sorted(
            (asks, 1, stage) for stage in ("load", "calibrate", "prune")
        )
