"""A job's end posted to its `webhook_url`: the job's JSON, signed in the form of the Standard Webhooks specification
(https://www.standardwebhooks.com, with its reference package), retried with backoff; every attempt an event of the
job.

Deliveries are read from the job rows (`webhook_state` "pending" once the job has finished), so a webhook is
not lost when the process that would send it stops: a notifier holds one with a lease, and another takes it
over, counting on from the attempts recorded, once the lease has run out.

Headers of each POST:
- `webhook-id: <job id>.<event>` (the same on every attempt, so a receiver can drop a repeat),
  `webhook-timestamp: <unix seconds>`, `webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`
  keyed with CASP_WEBHOOK_SECRET's key (`Settings.webhook_key`: a `whsec_<base64>` secret is read as the
  specification's libraries read it, so that the same string configures a receiver's)
- `Casp-Event: job.succeeded` (or `job.failed`, `job.cancelled`, or `job.stage` for a stage started, where the job's
  `webhook_events` name it: one delivery per stage an attempt starts, from its own rows, `stage_deliveries`)
"""

import base64
import ipaddress
import itertools
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlparse

import httpx
import tenacity
from standardwebhooks import Webhook

from service import webhook_deliveries
from service.db import session_scope
from service.settings import WEBHOOK_SECRET_PREFIX, Settings
from service.tables import Job, aware, utcnow

log = logging.getLogger(__name__)

EVENT_HEADER = "Casp-Event"
MAX_BACKOFF_SECONDS = 60.0

JobBody = Callable[[Job], dict[str, Any]]


class WebhookRefused(ValueError):
    """A webhook URL the settings do not allow."""


def host_allowed(host: str, allowed: list[str]) -> bool:
    host = host.lower().rstrip(".")
    entries = (entry.lower() for entry in allowed)
    return any(host == entry or (entry.startswith("*.") and host.endswith(entry[1:])) for entry in entries)


def check_webhook_url(url: str, settings: Settings) -> None:
    """Raises WebhookRefused unless the URL is http(s), its host is allowed and (unless private addresses are
    allowed) every address it resolves to is public. Checked at submit and again before each attempt, since
    what a name resolves to can change in between."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise WebhookRefused("must be an http:// or https:// URL with a host")
    if not host_allowed(parsed.hostname, settings.webhook_allowed_hosts):
        allowed = ", ".join(settings.webhook_allowed_hosts) or "none configured"
        raise WebhookRefused(f"the host is not one of CASP_WEBHOOK_ALLOWED_HOSTS ({allowed})")
    if settings.webhook_allow_private:
        return
    try:
        infos = socket.getaddrinfo(parsed.hostname, parsed.port or 443, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise WebhookRefused(f"the host does not resolve ({exc})") from exc
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global:
            raise WebhookRefused(f"the host resolves to {address}, not a public address (CASP_WEBHOOK_ALLOW_PRIVATE)")


# Bytes of key in a new secret: the specification asks for 24 to 64.
NEW_SECRET_BYTES = 32


def new_secret() -> str:
    """A random webhook secret in the specification's form, `whsec_` and the base64 of the key."""
    return WEBHOOK_SECRET_PREFIX + base64.b64encode(secrets.token_bytes(NEW_SECRET_BYTES)).decode()


def secret_form(secret: str) -> str:
    """How CASP_WEBHOOK_SECRET is read, in words for the log (never the secret itself)."""
    if secret.startswith(WEBHOOK_SECRET_PREFIX):
        return "a Standard Webhooks whsec_ key (the base64 after whsec_ decoded)"
    return "a raw string (its UTF-8 bytes are the key)"


def standard_headers(key: bytes, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """`webhook-id`, `webhook-timestamp` and `webhook-signature`, signed by the specification's reference code with
    `key` (`Settings.webhook_key`)."""
    signed = Webhook(key).sign(message_id, datetime.fromtimestamp(timestamp, UTC), body.decode())
    return {"webhook-id": message_id, "webhook-timestamp": str(timestamp), "webhook-signature": signed}


def post_signed(settings: Settings, url: str, body: bytes, event: str, message_id: str) -> tuple[bool, str]:
    """One attempt: (delivered, what happened)."""
    key = settings.webhook_key
    assert key is not None  # no job has a webhook without a secret (checked at submit)
    try:
        check_webhook_url(url, settings)
    except WebhookRefused as exc:
        return False, f"refused: {exc}"
    timestamp = int(time.time())
    headers = {
        "Content-Type": "application/json",
        **standard_headers(key, message_id, timestamp, body),
        EVENT_HEADER: event,
    }
    try:
        response = httpx.post(url, content=body, headers=headers, timeout=settings.webhook_timeout_seconds)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return response.is_success, f"HTTP {response.status_code}"


def lease_of(settings: Settings) -> timedelta:
    """Long enough for every attempt and wait: a live notifier never loses its lease."""
    return timedelta(seconds=settings.webhook_max_attempts * (settings.webhook_timeout_seconds + MAX_BACKOFF_SECONDS))


# Records an attempt: (what happened, the delivery's state after it: "pending", "delivered" or "failed").
RecordAttempt = Callable[[str, str], None]


def post_until_taken(
    settings: Settings,
    delivery: tuple[str, bytes, str, str],
    done_before: int,
    record: RecordAttempt,
    stopped: threading.Event,
) -> bool:
    """Posts `delivery` (url, body, event, message id) until it is taken (2xx) or the attempts are used up,
    counting on from `done_before`; records each attempt."""
    url, body, event, message_id = delivery
    numbers = itertools.count(done_before + 1)

    def attempt() -> bool:
        number = next(numbers)
        delivered, message = post_signed(settings, url, body, event, message_id)
        record(
            message, "delivered" if delivered else "failed" if number >= settings.webhook_max_attempts else "pending"
        )
        return delivered

    retrying = tenacity.Retrying(
        # At least one: a lower CASP_WEBHOOK_MAX_ATTEMPTS than when the attempts were made still ends the delivery.
        stop=tenacity.stop_after_attempt(max(1, settings.webhook_max_attempts - done_before))
        | tenacity.stop_when_event_set(stopped),
        wait=tenacity.wait_exponential(multiplier=settings.webhook_backoff_seconds, max=MAX_BACKOFF_SECONDS),
        retry=tenacity.retry_if_result(lambda delivered: not delivered),
        retry_error_callback=lambda state: False,
        # A shutdown cuts a wait short; the lease then runs out and another notifier goes on.
        sleep=stopped.wait,
    )
    return retrying(attempt)


def deliver(settings: Settings, job_body: JobBody, job_id: str, stopped: threading.Event) -> bool | None:
    """Posts the finished job to its webhook until it is taken (2xx) or the attempts are used up; None when
    another notifier holds it, it was delivered meanwhile, or the job's `webhook_events` leave its end out."""
    with session_scope(settings.database) as session:
        job = webhook_deliveries.claim_webhook(session, job_id, utcnow(), lease_of(settings))
        if job is None or job.webhook_url is None:
            return None
        event = f"job.{job.status}"
        if event not in (job.webhook_events or webhook_deliveries.FINAL_EVENTS):
            webhook_deliveries.skip_webhook(session, job_id)
            return None
        url, done_before = job.webhook_url, job.webhook_attempts
        body = json.dumps(job_body(job), separators=(",", ":")).encode()

    def record(message: str, state: str) -> None:
        with session_scope(settings.database) as session:
            webhook_deliveries.webhook_attempted(session, job_id, message, state=state)

    return post_until_taken(settings, (url, body, event, f"{job_id}.{event}"), done_before, record, stopped)


def deliver_stage(settings: Settings, delivery_id: int, stopped: threading.Event) -> bool | None:
    """Posts a `job.stage` delivery: `{"type": "job.stage", "job_id", "attempt", "stage", "started_at"}`, with the
    webhook id `<job id>.job.stage.<attempt>.<stage>`. None when another notifier holds it or it is done."""
    with session_scope(settings.database) as session:
        delivery = webhook_deliveries.claim_stage_delivery(session, delivery_id, utcnow(), lease_of(settings))
        if delivery is None:
            return None
        url = session.get_one(Job, delivery.job_id).webhook_url
        assert url is not None  # only a job with a webhook gets deliveries
        started_at = aware(delivery.started_at)
        payload = {
            "type": webhook_deliveries.STAGE_EVENT,
            "job_id": delivery.job_id,
            "attempt": delivery.attempt,
            "stage": delivery.stage,
            "started_at": started_at.isoformat().replace("+00:00", "Z"),
        }
        message_id = f"{delivery.job_id}.{webhook_deliveries.STAGE_EVENT}.{delivery.attempt}.{delivery.stage}"
        done_before = delivery.attempts
    body = json.dumps(payload, separators=(",", ":")).encode()

    def record(message: str, state: str) -> None:
        with session_scope(settings.database) as session:
            webhook_deliveries.stage_delivery_attempted(session, delivery_id, message, state=state)

    return post_until_taken(
        settings, (url, body, webhook_deliveries.STAGE_EVENT, message_id), done_before, record, stopped
    )


# Jobs whose deliveries are sent at once: a receiver that hangs until the timeout, or fails and is waited for,
# holds back its own job's deliveries and no other job's.
DELIVERY_THREADS = 8


class Notifier(threading.Thread):
    """Delivers the webhooks of jobs (stages started, ends); runs beside the API (casp_cli.app), where webhooks are
    on. A job's deliveries go one after another, oldest stage first and its end last, on one of DELIVERY_THREADS
    threads; each round hands out the jobs with deliveries due that are not already being sent."""

    def __init__(self, settings: Settings, job_body: JobBody) -> None:
        super().__init__(name="casp-notifier", daemon=True)
        self.settings = settings
        self.job_body = job_body
        self.stopped = threading.Event()

    def run(self) -> None:
        assert self.settings.webhook_secret  # the notifier runs only where webhooks are on
        log.info("webhooks on; CASP_WEBHOOK_SECRET read as %s", secret_form(self.settings.webhook_secret))
        sending: dict[str, Future[None]] = {}
        with ThreadPoolExecutor(DELIVERY_THREADS, thread_name_prefix="casp-webhook") as pool:
            while not self.stopped.wait(self.settings.webhook_poll_seconds):
                sending = {job_id: future for job_id, future in sending.items() if not future.done()}
                try:
                    with session_scope(self.settings.database) as session:
                        stages = webhook_deliveries.pending_stage_deliveries(session, utcnow())
                        ends = webhook_deliveries.pending_webhooks(session, utcnow())
                except Exception as exc:  # the database may be briefly away; try again next round
                    log.warning("webhook round failed: %s: %s", type(exc).__name__, exc)
                    continue
                due: dict[str, list[int]] = {}
                for delivery_id, job_id in stages:
                    due.setdefault(job_id, []).append(delivery_id)
                ended = set(ends)
                for job_id in ends:
                    due.setdefault(job_id, [])
                for job_id, stage_ids in due.items():
                    if job_id not in sending:
                        sending[job_id] = pool.submit(self.deliver_job, job_id, stage_ids, job_id in ended)

    def deliver_job(self, job_id: str, stage_ids: list[int], end: bool) -> None:
        try:
            for delivery_id in stage_ids:
                if self.stopped.is_set():
                    return
                deliver_stage(self.settings, delivery_id, self.stopped)
            if end and not self.stopped.is_set():
                deliver(self.settings, self.job_body, job_id, self.stopped)
        except Exception as exc:  # as a round: the next one tries again once the lease has run out
            log.warning("webhook delivery of job %s failed: %s: %s", job_id, type(exc).__name__, exc)
