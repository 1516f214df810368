"""Takes back jobs whose worker stopped beating: queued again (and re-sent), or failed after the last attempt.
Sends again queued jobs that have no message in the broker: their send failed, or the broker lost it.
Deletes the artifacts of jobs past their expiry (retention).

Runs as a thread beside every API process (distributed and embedded; `casp_cli.app` starts it with the app):
the API is always up, and the conditional updates in service.job_queue make several reapers at once harmless.
"""

import logging
import threading
from datetime import timedelta

from service import expiry, job_queue, uploaded_models
from service.db import session_scope
from service.dispatch import Dispatcher, send
from service.settings import Settings
from service.storage import S3Storage, Storage
from service.tables import utcnow

log = logging.getLogger(__name__)

LOST_MESSAGE = "the broker no longer holds the job's message (restarted without persistence?); sent again"


def reap_once(settings: Settings, dispatcher: Dispatcher) -> job_queue.Reaped:
    with session_scope(settings.database) as session:
        reaped = job_queue.reap(
            session,
            heartbeat_timeout=settings.heartbeat_timeout_seconds,
            max_attempts=settings.max_attempts,
            time_limit=settings.job_time_limit_seconds,
        )
    # Sent after the commit, so a worker that receives the message finds the row queued.
    for job_id, queue, mark in reaped.requeued:
        send(settings, dispatcher, job_id, queue, mark, failure_event=True)
    if reaped.requeued or reaped.ended:
        log.warning("reaper: queued again %s, ended %s", [j for j, _, _ in reaped.requeued], reaped.ended)
    send_unsent(settings, dispatcher)
    resend_lost(settings, dispatcher)
    return reaped


def send_unsent(settings: Settings, dispatcher: Dispatcher) -> list[str]:
    """Queued jobs whose send failed, oldest first; stops at the first failure (the broker is still away)."""
    with session_scope(settings.database) as session:
        unsent = job_queue.unsent_jobs(session)
    sent = []
    for job_id, queue in unsent:
        with session_scope(settings.database) as session:
            mark = job_queue.claim_dispatch(session, job_id, was=None)
        if mark is None:
            continue
        if not send(settings, dispatcher, job_id, queue, mark, failure_event=False):
            break
        sent.append(job_id)
    if sent:
        log.warning("reaper: sent %d jobs the broker had not taken: %s", len(sent), sent)
    return sent


def resend_lost(settings: Settings, dispatcher: Dispatcher) -> list[str]:
    """Queued jobs sent more than a reaper round ago whose message is neither waiting in the broker nor held
    by a worker: the broker lost it (a restart without persistence). A job waiting its turn behind others
    still has its message in the queue and is left alone."""
    cutoff = utcnow() - timedelta(seconds=settings.reaper_interval_seconds)
    # The database first, then the broker: a message taken by a worker in between belongs to a job that is
    # running by the time it is re-marked, and claim_dispatch leaves it alone.
    with session_scope(settings.database) as session:
        candidates = job_queue.dispatched_before(session, cutoff)
    if not candidates:
        return []
    held = dispatcher.held_job_ids()
    if held is None:
        return []
    resent = []
    for job_id, queue, was in candidates:
        if job_id in held:
            continue
        with session_scope(settings.database) as session:
            mark = job_queue.claim_dispatch(session, job_id, was=was, reason=LOST_MESSAGE)
        if mark is not None and send(settings, dispatcher, job_id, queue, mark, failure_event=True):
            resent.append(job_id)
    if resent:
        log.warning("reaper: the broker had lost the messages of %s; sent again", resent)
    return resent


def sweep_expired(settings: Settings, storage: Storage) -> list[str]:
    """Deletes from storage the artifacts of jobs past their expiry, then marks the jobs (with an event).
    Storage first: a sweep that stops between the two finds the job again next round, and deleting twice is
    harmless; two sweeps at once both delete, and one of them marks."""
    with session_scope(settings.database) as session:
        expired = expiry.expired_jobs(session, utcnow())
    swept = []
    for job_id in expired:
        try:
            storage.delete(job_id)
        except Exception as exc:  # the storage is away: the job stays unmarked, and the next round tries again
            log.warning("retention: could not delete the artifacts of job %s: %s", job_id, exc)
            continue
        with session_scope(settings.database) as session:
            if expiry.mark_expired(session, job_id):
                swept.append(job_id)
    if swept:
        log.info("retention: deleted the expired artifacts of %s", swept)
    return swept


def sweep_expired_uploads(settings: Settings, storage: Storage) -> list[str]:
    """Uploaded models past their expiry: files first, then the row (as for artifacts, a stop between the two only
    means the next round deletes again)."""
    with session_scope(settings.database) as session:
        expired = uploaded_models.expired_uploads(session, utcnow())
    swept = []
    for model_id in expired:
        try:
            storage.delete_model(model_id)
        except Exception as exc:  # the storage is away: the next round tries again
            log.warning("retention: could not delete the uploaded model %s: %s", model_id, exc)
            continue
        with session_scope(settings.database) as session:
            uploaded_models.forget_upload(session, model_id)
        swept.append(model_id)
    if swept:
        log.info("retention: deleted the expired uploaded models %s", swept)
    return swept


def sweep_expired_pending_uploads(settings: Settings, storage: Storage) -> list[str]:
    """Presigned uploads never completed: their tar (if one was PUT), then the row."""
    with session_scope(settings.database) as session:
        expired = uploaded_models.expired_pending_uploads(session, utcnow())
    for upload_id in expired:
        if isinstance(storage, S3Storage):  # only S3 storage hands out presigned uploads
            storage.delete_pending_upload(upload_id)
        with session_scope(settings.database) as session:
            uploaded_models.forget_pending_upload(session, upload_id)
    if expired:
        log.info("retention: deleted the expired presigned uploads %s", list(expired))
    return list(expired)


class Reaper(threading.Thread):
    def __init__(self, settings: Settings, dispatcher: Dispatcher, storage: Storage) -> None:
        super().__init__(name="casp-reaper", daemon=True)
        self.settings = settings
        self.dispatcher = dispatcher
        self.storage = storage
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.settings.reaper_interval_seconds):
            # Each on its own: a broker outage must not hold back the retention sweep, nor the reverse.
            try:
                reaped = reap_once(self.settings, self.dispatcher)
                # A job failed for good keeps no work in progress (a job ended by its attempt drops its own).
                for job_id in reaped.ended:
                    self.storage.delete_work(job_id)
            except Exception as exc:  # the database or the broker may be briefly away; try again next round
                log.warning("reaper round failed: %s: %s", type(exc).__name__, exc)
            try:
                sweep_expired(self.settings, self.storage)
                sweep_expired_uploads(self.settings, self.storage)
                sweep_expired_pending_uploads(self.settings, self.storage)
            except Exception as exc:  # the database may be briefly away; try again next round
                log.warning("retention sweep failed: %s: %s", type(exc).__name__, exc)
