"""Runs one job through casp_core: claim the row, stream progress into it, upload, mark it.

Shared by the Celery task (distributed mode) and the in-process worker threads (embedded mode).
"""

import contextlib
import contextvars
import logging
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from casp_core.errors import Cancelled, CaspError
from casp_core.job.run import run_job
from casp_core.job.stages import SINGLE_RATIO, Stage, job_stages
from casp_core.job.steps import RETRY_FILES
from casp_core.model import resolve_device
from casp_core.run import Run
from casp_core.settings import PruneConfig
from service import job_queue, jobs
from service.db import session_scope
from service.logs import add_log_context, job_log_context
from service.model_sources import local_model, locate
from service.paths import check_job_inputs, is_remote_model
from service.security import decrypt_hub_token
from service.settings import AUTO, Settings
from service.storage import Storage
from service.tables import ApiKey, Job

log = logging.getLogger(__name__)

# The service's own stages around the job's (casp_core.job.stages): a model from a bucket or an upload is fetched
# first, the job's files are stored last. The e2e test checks the whole order against the real pipeline.
DOWNLOAD = Stage("download", 5)
UPLOAD = Stage("upload", 5)


@dataclass(frozen=True)
class Segments:
    """The job's stages (`job_stages`, then "upload") and where each starts on the overall 0-100 scale: their
    weights, scaled so that the stages this job reports add up to 100."""

    stages: tuple[str, ...]
    starts: tuple[float, ...]
    shares: tuple[float, ...]

    @classmethod
    def of(cls, stages: tuple[Stage, ...]) -> "Segments":
        stages = (*stages, UPLOAD)
        total = sum(stage.weight for stage in stages)
        shares = tuple(100 * stage.weight / total for stage in stages)
        return cls(tuple(stage.name for stage in stages), tuple(sum(shares[:i]) for i in range(len(stages))), shares)

    def next(self, stage: str, current: int) -> int:
        """The segment a report of `stage` belongs to: the current one or the next of that name (a stage the
        table does not know, or one reported out of order, stays in the current segment)."""
        for index in range(current, len(self.stages)):
            if self.stages[index] == stage:
                return index
        return current

    def progress(self, segment: int, fraction: float) -> float:
        return self.starts[segment] + self.shares[segment] * min(max(fraction, 0.0), 1.0)


# Row updates at most this often, and an event per whole percent at most: a long run writes a few hundred
# rows, not one per callback.
WRITE_INTERVAL_SECONDS = 1.0
CANCEL_POLL_SECONDS = 0.25


def worker_name() -> str:
    return f"{socket.gethostname()}:{threading.get_native_id()}"


@dataclass
class Attempt:
    """One attempt at a job: what the progress callback, the cancel check and the heartbeat share."""

    settings: Settings
    job_id: str
    number: int
    deadline: float
    stop_requested: Callable[[], bool] = lambda: False  # the embedded server shutting down
    segments: Segments = field(default_factory=lambda: Segments.of(SINGLE_RATIO))
    stage: str | None = None
    segment: int = 0
    progress: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    lost: bool = False  # the row is no longer this attempt's (reaped, cancelled while queued again)
    timed_out: bool = False
    _stage_started: float = field(default_factory=time.monotonic)
    _last_write: float = 0.0
    _last_event_progress: float = -1.0
    _last_poll: float = 0.0
    _stop: bool = False

    def report(self, stage: str, fraction: float, message: str = "", always_event: bool = False) -> None:
        now = time.monotonic()
        self.segment = self.segments.next(stage, self.segment)
        progress = max(self.progress, self.segments.progress(self.segment, fraction))
        changed = stage != self.stage
        if changed:
            self._close_stage(now)
            self.stage = stage
            add_log_context(stage=stage)
            log.info("stage %s started", stage)
        self.progress = progress
        event = changed or always_event or progress - self._last_event_progress >= 1.0
        if not (event or now - self._last_write >= WRITE_INTERVAL_SECONDS):
            return
        self._last_write = now
        with session_scope(self.settings.database) as session:
            if not job_queue.touch(session, self.job_id, self.number, stage=stage, progress=round(progress, 2)):
                self.lost = True
                return
            if event:
                self._last_event_progress = progress
                job = session.get_one(Job, self.job_id)
                jobs.add_event(session, job, kind="progress", message=message)

    def warn(self, message: str) -> None:
        """A warning from the pipeline: an event at once (the job's `result.warnings` has it at the end)."""
        with session_scope(self.settings.database) as session:
            jobs.add_event(session, session.get_one(Job, self.job_id), kind="warning", message=message)

    def _close_stage(self, now: float) -> None:
        if self.stage is not None:
            self.timings[self.stage] = self.timings.get(self.stage, 0.0) + now - self._stage_started
        self._stage_started = now

    def should_cancel(self) -> bool:
        """Polled by casp_core at every layer boundary; reads the row at most every CANCEL_POLL_SECONDS."""
        if self._stop or self.lost:
            return True
        now = time.monotonic()
        if now >= self.deadline:
            self.timed_out = self._stop = True
        elif self.stop_requested():
            self._stop = True
        elif now - self._last_poll >= CANCEL_POLL_SECONDS:
            self._last_poll = now
            with session_scope(self.settings.database) as session:
                self._stop = job_queue.should_stop(session, self.job_id, self.number)
        return self._stop

    def finish(self, status: str, **kwargs: Any) -> bool:
        self._close_stage(time.monotonic())
        with session_scope(self.settings.database) as session:
            finished = job_queue.finish(
                session, self.job_id, self.number, status=status, timings=self.timings, **kwargs
            )
        if finished:
            seconds = {stage: round(value, 3) for stage, value in self.timings.items()}
            log.info("attempt %d ended %s", self.number, status, extra={"stage_seconds": seconds})
        return finished


class Heartbeat(threading.Thread):
    """Proves the attempt alive while a stage runs long without progress callbacks (loading a large model);
    when it stops, the reaper takes the job back."""

    def __init__(self, attempt: Attempt) -> None:
        super().__init__(name=f"heartbeat-{attempt.job_id}", daemon=True)
        self.attempt = attempt
        self.done = threading.Event()
        # A thread starts with an empty context: this one logs in its job's (see service.logs).
        self.context = contextvars.copy_context()

    def run(self) -> None:
        self.context.run(self._beat)

    def _beat(self) -> None:
        interval = self.attempt.settings.heartbeat_interval_seconds
        while not self.done.wait(interval):
            try:
                with session_scope(self.attempt.settings.database) as session:
                    if not job_queue.touch(session, self.attempt.job_id, self.attempt.number):
                        self.attempt.lost = True
                        return
            except Exception:  # a database hiccup must not end the job; the next beat retries
                log.exception("heartbeat of job %s failed", self.attempt.job_id)


# Beside the attempts' folders and removed with them when an attempt ends. Each save is copied to the job's
# storage too, and an attempt starts from the stored copy: a retry after a killed attempt (the reaper queues the
# job again) resumes after pruning, and the recovery stage from its last save; a sweep after the candidates it
# measured; on whichever machine it runs.
RETRY_STATE = "retry-state"
RECOVERY_SUMMARY = ("steps", "tokens", "tokens_per_second", "precision", "resumed_from_step", "teacher")
FRONTIER_SUMMARY = ("ratio", "format", "variant", "bytes", "params", "perplexity", "within_target", "dense")


def summary_of(report: dict[str, Any]) -> dict[str, Any]:
    keys = ("source", "achieved_ratio", "params", "perplexity", "quantization", "artifacts", "warnings")
    summary = {key: report[key] for key in keys if key in report}
    if zero_shot := report.get("evaluation", {}).get("zero_shot"):
        summary["zero_shot"] = zero_shot_summary(zero_shot)
    # For display (0.30000000000000004 reads as a defect); report.json keeps the exact ratio.
    summary["achieved_ratio"] = round(report["achieved_ratio"], 6)
    if "recovery" in report:
        recovery = report["recovery"]
        summary["recovery"] = {key: recovery[key] for key in RECOVERY_SUMMARY}
        summary["recovery"]["final_loss"] = recovery["curve"][-1]["loss"] if recovery["curve"] else None
    if "frontier" in report:
        frontier = report["frontier"]
        front = [point for point in frontier["candidates"] if point["on_front"]]
        summary["frontier"] = {
            "target": frontier["target"],
            "front": [{key: point[key] for key in FRONTIER_SUMMARY} for point in front],
            "pick": {key: frontier["pick"][key] for key in FRONTIER_SUMMARY},
        }
        if "dense_pick" in frontier:  # why the dense model was handed back, beside the best pruned point
            best_pruned = frontier["best_pruned"]
            summary["frontier"]["dense_pick"] = frontier["dense_pick"]
            summary["frontier"]["best_pruned"] = best_pruned and {key: best_pruned[key] for key in FRONTIER_SUMMARY}
    return summary


def zero_shot_summary(zero_shot: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each task's accuracy on each model measured (`dense`, `pruned`, and `recovered` after recovery) and the
    documents scored, as `perplexity` gives each data set's; report.json keeps the harness's whole output."""
    summary: dict[str, dict[str, Any]] = {}
    for task, pruned in zero_shot["pruned"]["tasks"].items():
        summary[task] = {model: figures["tasks"][task]["acc"] for model, figures in zero_shot.items()}
        summary[task]["n_samples"] = pruned["n_samples"]
    return summary


def job_config(job: Job, settings: Settings) -> PruneConfig:
    """The settings the pipeline runs the job with: the stored request's, on this worker's device."""
    # A job for any device runs on this worker's own (its default device, resolved when it started).
    device = settings.default_device if job.device == AUTO else job.device
    return PruneConfig.from_dict({**job.config, "device": device})


def execute(
    job_id: str,
    settings: Settings,
    storage: Storage,
    *,
    worker_id: str | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> str | None:
    """Runs the job if it is still queued; returns its final status (None when it was not ours to run,
    or the attempt was released or lost midway). Everything logged meanwhile carries the job's id, its
    owner's key name and the stage (service.logs)."""
    with job_log_context(job_id) as log_context:
        with session_scope(settings.database) as session:
            job = job_queue.claim_job(session, job_id, worker_id or worker_name())
            if job is None:
                log.info("job %s is not queued; nothing to do", job_id)
                return None
            config = job_config(job, settings)
            model, revision, number, owner_id = job.model, job.revision, job.attempts, job.owner_id
            owner = session.get(ApiKey, job.owner_id) if job.owner_id else None
            log_context.key_name = owner.name if owner else None
            hub_token = owner.hub_token if owner else None

        attempt = Attempt(
            settings,
            job_id,
            number,
            deadline=time.monotonic() + settings.job_time_limit_seconds,
            stop_requested=stop_requested,
            segments=Segments.of((*((DOWNLOAD,) if is_remote_model(model) else ()), *job_stages(config))),
        )
        out_dir = settings.home / "work" / job_id / f"attempt-{number}"
        shutil.rmtree(out_dir, ignore_errors=True)  # a rerun starts clean: nothing half-written is kept
        out_dir.mkdir(parents=True)
        heartbeat = Heartbeat(attempt)
        heartbeat.start()
        status = None
        try:
            status = _run(attempt, JobModel(model, revision, owner_id, hub_token), config, out_dir, storage)
            return status
        finally:
            heartbeat.done.set()
            heartbeat.join()
            shutil.rmtree(out_dir.parent, ignore_errors=True)
            if status is not None:  # the job has ended: no retry needs its work in progress
                _drop_work(storage, job_id)


def peak_gpu_memory(device: torch.device) -> dict[str, int]:
    """`peak_gpu_memory_bytes` of a job that ran on CUDA: the most memory torch held allocated at once on
    its device since the job started (_run resets the count; Celery gives each job a fresh process, while the
    embedded mode's worker threads share one, so there it is the peak of whatever ran beside the job too)."""
    if device.type != "cuda":
        return {}
    return {"peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(device)}


@dataclass(frozen=True)
class JobModel:
    """What the job prunes, and what its key gives to read it with."""

    reference: str  # as the job stores it: a hub id, a local folder, `s3://...` or `casp://models/<id>`
    revision: str | None
    owner_id: str | None
    hub_token: str | None  # the key's, encrypted (service.security); decrypted only to hand it to the loader

    def __repr__(self) -> str:  # in no log or traceback, even encrypted
        return f"JobModel({self.reference!r})"


@contextlib.contextmanager
def model_folder(attempt: Attempt, model: JobModel, storage: Storage) -> Iterator[str]:
    """What casp_core loads: a bucket's or an upload's model as a local folder or GGUF file (downloaded into the model
    cache, its progress the "download" stage's), anything else as the job names it."""
    if not is_remote_model(model.reference):
        yield model.reference
        return
    with session_scope(attempt.settings.database) as session:
        source = locate(session, model.reference, model.owner_id, storage, attempt.settings)

    def progress(fraction: float, message: str) -> None:
        attempt.report("download", fraction, message, always_event=fraction >= 1.0)

    with local_model(source, attempt.settings, progress, attempt.should_cancel) as local:
        yield str(local)


def _run(attempt: Attempt, model: JobModel, config: PruneConfig, out_dir: Path, storage: Storage) -> str | None:
    try:
        # Checked again here: the row may have been written past the API, or the roots changed since.
        check_job_inputs(model.reference, config, attempt.settings)
        keys = attempt.settings.verification_keys
        token = decrypt_hub_token(keys, model.hub_token) if model.hub_token else None
        # A device this machine lacks fails the job here, with casp_core's device_unavailable.
        device = resolve_device(config.device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        state_dir = out_dir.parent / RETRY_STATE
        if config.keeps_retry_state:
            _restore_retry_state(storage, attempt.job_id, state_dir)
        with model_folder(attempt, model, storage) as folder:
            report = run_job(
                folder,
                config,
                out_dir,
                Run(progress=attempt.report, should_cancel=attempt.should_cancel, on_warning=attempt.warn),
                revision=model.revision,
                retry_state=state_dir,
                on_retry_state_saved=lambda path: _keep_retry_state(storage, attempt.job_id, path),
                token=token,
                cache_dir=attempt.settings.cache,
            )
        if attempt.should_cancel():
            raise Cancelled("the job was cancelled")
        attempt.report("upload", 0.0, "uploading artifacts")
        try:
            stored = storage.upload_dir(attempt.job_id, out_dir)
        except Exception as exc:
            log.exception("upload of job %s failed", attempt.job_id)
            _drop_upload(storage, attempt.job_id)
            error = ("upload_failed", f"could not store the artifacts: {type(exc).__name__}: {exc}")
            return "failed" if attempt.finish("failed", error=error) else None
        attempt.report("upload", 1.0, f"uploaded {len(stored)} files")
        if attempt.finish("succeeded", result={**summary_of(report), **peak_gpu_memory(device)}, artifacts=stored):
            return "succeeded"
        # A cancel came during the upload, or the attempt lost the row: drop the upload if cancelled.
        if not attempt.lost and attempt.finish("cancelled"):
            storage.delete(attempt.job_id)
            return "cancelled"
        return None
    except Cancelled:
        if attempt.timed_out:
            limit = attempt.settings.job_time_limit_seconds
            error = ("time_limit_exceeded", f"the job ran longer than the time limit of {limit} s")
            return "failed" if attempt.finish("failed", error=error) else None
        if attempt.lost:
            return None
        if attempt.stop_requested():
            _release(attempt)
            return None
        return "cancelled" if attempt.finish("cancelled") else None
    except CaspError as exc:
        return "failed" if attempt.finish("failed", error=(exc.code, exc.message)) else None
    except Exception as exc:
        log.exception("job %s failed", attempt.job_id)
        error = ("internal_error", f"{type(exc).__name__}: {exc}")
        return "failed" if attempt.finish("failed", error=error) else None


def _drop_upload(storage: Storage, job_id: str) -> None:
    """Removes what a failed upload stored, so that no partial checkpoint stays behind; the job's artifact
    list was never written (that happens only with success)."""
    try:
        storage.delete(job_id)
    except Exception:  # the storage is failing: what remains is overwritten by a rerun, or deleted with the job
        log.exception("could not remove the partial upload of job %s", job_id)


def _restore_retry_state(storage: Storage, job_id: str, state_dir: Path) -> None:
    """Puts the stored pruned model and training state, a sweep's state, the zero-shot scores, the latest saves of
    any attempt, in `state_dir` (where an earlier attempt on this machine may have left older ones)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    for name in RETRY_FILES:
        try:
            if storage.get_work(job_id, name, state_dir / name):
                log.info("job %s: %s restored from storage", job_id, name)
        except Exception:  # the storage is failing: the job resumes from a local save, if any, or starts over
            log.exception("could not restore %s of job %s", name, job_id)


def _keep_retry_state(storage: Storage, job_id: str, path: Path) -> None:
    try:
        storage.put_work(job_id, path)
    except Exception:  # the job goes on; only a retry elsewhere loses this save
        log.exception("could not store %s of job %s", path.name, job_id)


def _drop_work(storage: Storage, job_id: str) -> None:
    try:
        storage.delete_work(job_id)
    except Exception:  # the storage is failing: the work stays until the job's artifacts are deleted
        log.exception("could not remove the work in progress of job %s", job_id)


def _release(attempt: Attempt) -> None:
    """The embedded server is stopping: the job goes back to the queue for the next start."""
    with session_scope(attempt.settings.database) as session:
        job_queue.release(session, attempt.job_id, attempt.number)
