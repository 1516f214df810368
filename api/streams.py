"""The event streams of `GET /v1/jobs/{id}/events?stream=true`: they wait for the job's notification
(service.events), holding no database connection meanwhile, read what is new in a worker thread, and end once
the job has finished and its events are sent. Streams of the same job share their reads. Each key may hold
CASP_MAX_STREAMS_PER_KEY streams at once in a process; past that it is told to poll instead (429)."""

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi.concurrency import run_in_threadpool
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from api.errors import ApiError
from api.schemas import EventOut
from service.db import get_engine
from service.events import EventHub, hub_of

# A comment that keeps proxies from closing a quiet stream.
PING_SECONDS = 15
# What a refused stream is told to wait before it tries again (it polls meanwhile).
STREAM_RETRY_AFTER_SECONDS = 10

# Reads a job's events after an id (None: from the first): (the events, whether the job had finished first).
EventReader = Callable[[str, int | None], tuple[list[EventOut], bool]]


class StreamSlots:
    """Streams held per key in this process (None: auth off, every caller alike)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.held: dict[str | None, int] = {}

    def take(self, key_id: str | None) -> None:
        with self.lock:
            held = self.held.get(key_id, 0)
            if held >= self.limit:
                raise ApiError(
                    429,
                    f"this key holds {held} event streams, its limit (CASP_MAX_STREAMS_PER_KEY) is {self.limit};"
                    " poll GET /v1/jobs/{id}/events?after=<last event id> instead, or close a stream",
                    "max_streams_exceeded",
                    headers={"Retry-After": str(STREAM_RETRY_AFTER_SECONDS)},
                )
            self.held[key_id] = held + 1

    def give_back(self, key_id: str | None) -> None:
        with self.lock:
            left = self.held[key_id] - 1
            if left:
                self.held[key_id] = left
            else:
                del self.held[key_id]


@dataclass
class Read:
    generation: int
    after: int | None
    events: list[EventOut]
    done: bool


class JobWatch:
    """The streams of one job in this event loop: woken together by its notifications, and one read serves
    those that ask for the same events (they have all seen the same ones)."""

    def __init__(self, job_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.job_id = job_id
        self.loop = loop
        self.generation = 0  # notifications so far: a read is current while none came after it began
        self.wakers: set[asyncio.Event] = set()
        self.lock = asyncio.Lock()
        self.last: Read | None = None

    def notified(self) -> None:
        """From any thread: the job has new events."""
        self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.generation += 1
        for waker in self.wakers:
            waker.set()

    async def read(self, after: int | None, reader: EventReader) -> tuple[list[EventOut], bool]:
        async with self.lock:
            last = self.last
            if last is not None and last.generation == self.generation and last.after == after:
                return last.events, last.done
            generation = self.generation
            events, done = await run_in_threadpool(reader, self.job_id, after)
            self.last = Read(generation, after, events, done)
            return events, done


class Watches:
    """The JobWatch of each job with streams in this process, registered with the database's hub."""

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self.by_job: dict[str, JobWatch] = {}

    @asynccontextmanager
    async def waker(self, job_id: str) -> AsyncIterator[tuple[JobWatch, asyncio.Event]]:
        watch = self.by_job.get(job_id)
        if watch is None:
            watch = self.by_job[job_id] = JobWatch(job_id, asyncio.get_running_loop())
            self.hub.add(job_id, watch.notified)
        waker = asyncio.Event()
        watch.wakers.add(waker)
        try:
            yield watch, waker
        finally:
            watch.wakers.discard(waker)
            if not watch.wakers:
                del self.by_job[job_id]
                self.hub.remove(job_id, watch.notified)


def watches_for(database_url: str) -> Watches:
    return Watches(hub_of(get_engine(database_url)))


async def event_stream(
    watches: Watches, job_id: str, after: int | None, reader: EventReader
) -> AsyncIterator[ServerSentEvent]:
    """Every event as it is committed, until the job has finished and its events so far are sent."""
    async with watches.waker(job_id) as (watch, waker):
        while True:
            # Cleared before the read: a notification during it wakes the next wait at once.
            waker.clear()
            events, done = await watch.read(after, reader)
            for event in events:
                yield ServerSentEvent(data=event.model_dump_json(), id=str(event.id), event=event.kind)
            if events:
                after = events[-1].id
            elif done:
                return
            else:
                await waker.wait()


class StreamResponse(EventSourceResponse):
    """An event stream that gives its slot back however it ends (sent out, client gone, server stopping)."""

    def __init__(self, content: AsyncIterator[ServerSentEvent], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, ping=PING_SECONDS, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
