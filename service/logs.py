"""Logs: plain text for a terminal, or one JSON object a line (CASP_LOG_FORMAT=json) for a log collector.

Every record emitted on behalf of a job carries `job_id`, `key_name` (the name of the API key that owns the
job) and `stage`, set by whoever handles the job: the worker for the whole run, the API for one request. They
travel in a context variable holding one mutable `JobLogContext`, so that a stage change made by the thread
running the pipeline shows in the heartbeat thread's records too (that thread runs in a copy of the context).
"""

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

LogFormat = Literal["text", "json"]
CONTEXT_FIELDS = ("job_id", "key_name", "stage")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class JobLogContext:
    job_id: str | None = None
    key_name: str | None = None
    stage: str | None = None


_current: ContextVar[JobLogContext | None] = ContextVar("casp_job_log_context", default=None)


@contextmanager
def job_log_context(job_id: str | None = None, key_name: str | None = None) -> Iterator[JobLogContext]:
    """Records emitted inside carry the context's fields (those set, at the time of each record)."""
    context = JobLogContext(job_id=job_id, key_name=key_name)
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def add_log_context(**fields: str | None) -> None:
    """Sets fields (`job_id`, `key_name`, `stage`) of the current context; nothing outside one."""
    context = _current.get()
    if context is not None:
        for name, value in fields.items():
            setattr(context, name, value)


_plain_record_factory = logging.getLogRecordFactory()


def _record_with_context(*args: Any, **kwargs: Any) -> logging.LogRecord:
    record = _plain_record_factory(*args, **kwargs)
    context = _current.get()
    if context is not None:
        for name in CONTEXT_FIELDS:
            value = getattr(context, name)
            if value is not None:
                setattr(record, name, value)
    return record


def json_formatter() -> logging.Formatter:
    # Any attribute a record carries beyond the standard ones (the context fields, `extra=`) becomes a key.
    return JsonFormatter(
        "{levelname}{name}{message}",
        style="{",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp="time",  # ISO 8601, UTC
        # uvicorn's `color_message` repeats the message with terminal colour codes.
        reserved_attrs=[*RESERVED_ATTRS, "color_message"],
    )


def install_record_context() -> None:
    """Makes every record created in this process carry the job context (idempotent)."""
    logging.setLogRecordFactory(_record_with_context)


def without_progress_bars(log_format: LogFormat) -> None:
    """In JSON mode, no tqdm bar: in a log, lm-eval's ("Building contexts") are lines of no format, or, under
    Celery's redirect of what is printed, a WARNING record a redraw. tqdm reads TQDM_DISABLE once, when first
    imported, so `casp serve` and `casp worker` call this before importing the libraries that draw them."""
    if log_format == "json":
        os.environ.setdefault("TQDM_DISABLE", "1")


def configure_logging(log_format: LogFormat, level: str | int) -> None:
    """The root logger writes to stderr in `log_format`; what libraries log propagates to it."""
    install_record_context()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(json_formatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
    if log_format == "json":
        # Progress bars (loading and writing weights, data sets) are drawn for a terminal; in a JSON log they
        # would be lines of no format. A job's progress is in its events and its `stage ... started` records.
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # Hugging Face Hub's (and so datasets') bars too
