"""How a committed job event reaches whoever waits for it in this process (the API's event streams), with no
poll per waiter: one hub per database, told which jobs have new events.

- PostgreSQL (the distributed mode, whose workers are other processes): `service.jobs.add_event` issues
  `pg_notify(CHANNEL, job id)` in the event's own transaction, which PostgreSQL delivers when, and only if, it
  commits; one listener thread per process and database (`LISTEN`, a connection of its own) hands the job ids
  to the hub. It runs while something waits, and wakes every waiter each time it (re)connects, since anything
  committed while it was not listening has to be read again.
- SQLite (the embedded mode, whose workers are threads of the API process): the session notes the job ids and
  the hub is told after its commit.

Waiters register a callback per job; callbacks run in the thread that learnt of the event and must only hand
the news on (an asyncio waiter: `loop.call_soon_threadsafe`).
"""

import logging
import threading
from collections.abc import Callable, Iterable

import psycopg
from sqlalchemy import Engine, event, func, select
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

CHANNEL = "casp_job_events"
# How often the listener looks whether anyone still waits (and stops when not), and how long it waits before
# reconnecting.
LISTEN_TICK_SECONDS = 1.0
RECONNECT_SECONDS = 1.0
# Session.info key of the jobs that got events in the session's transaction (SQLite: told after the commit).
PENDING_KEY = "casp_event_jobs"

Callback = Callable[[], None]


class EventHub:
    """The waiters of one database in this process, by job id."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.waiting: dict[str, set[Callback]] = {}
        self.listener: threading.Thread | None = None

    def add(self, job_id: str, callback: Callback) -> None:
        with self.lock:
            self.waiting.setdefault(job_id, set()).add(callback)
            if self.engine.dialect.name == "postgresql" and self.listener is None:
                self.listener = threading.Thread(target=self._listen, name="casp-event-listener", daemon=True)
                self.listener.start()

    def remove(self, job_id: str, callback: Callback) -> None:
        with self.lock:
            callbacks = self.waiting.get(job_id)
            if callbacks is not None:
                callbacks.discard(callback)
                if not callbacks:
                    del self.waiting[job_id]

    def publish(self, job_ids: Iterable[str]) -> None:
        with self.lock:
            callbacks = [callback for job_id in job_ids for callback in self.waiting.get(job_id, ())]
        for callback in callbacks:
            callback()

    def publish_all(self) -> None:
        with self.lock:
            callbacks = [callback for callbacks in self.waiting.values() for callback in callbacks]
        for callback in callbacks:
            callback()

    def _idle(self) -> bool:
        """True, and the listener forgotten, when nobody waits: it stops, and the next waiter starts another."""
        with self.lock:
            if self.waiting:
                return False
            self.listener = None
            return True

    def _listen(self) -> None:
        conninfo = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while True:
            try:
                with psycopg.connect(conninfo, autocommit=True) as connection:
                    connection.execute(f"LISTEN {CHANNEL}")
                    # Listening from here on: what was committed before is found by a read after this wake-up.
                    self.publish_all()
                    while True:
                        # Each notification is handed on as it comes; the generator ends after the tick.
                        for note in connection.notifies(timeout=LISTEN_TICK_SECONDS):
                            self.publish([note.payload])
                        if self._idle():
                            return
            except psycopg.Error as exc:
                log.warning("event listener: %s: %s; reconnecting", type(exc).__name__, exc)
            if self._idle():
                return
            # Waiters read again once it listens again; until then they wait (their pings still flow).
            threading.Event().wait(RECONNECT_SECONDS)


_hubs: dict[Engine, EventHub] = {}
_hubs_lock = threading.Lock()


def hub_of(engine: Engine) -> EventHub:
    """The one hub of this database in this process."""
    with _hubs_lock:
        hub = _hubs.get(engine)
        if hub is None:
            hub = _hubs[engine] = EventHub(engine)
        return hub


def note_event(session: Session, job_id: str) -> None:
    """Called with each event written: PostgreSQL notifies at commit; elsewhere the job is told after it."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_notify(CHANNEL, job_id)))
    else:
        session.info.setdefault(PENDING_KEY, set()).add(job_id)


@event.listens_for(Session, "after_commit")
def _publish_committed(session: Session) -> None:
    job_ids = session.info.pop(PENDING_KEY, None)
    if job_ids:
        hub_of(session.get_bind().engine).publish(job_ids)


@event.listens_for(Session, "after_rollback")
def _forget_rolled_back(session: Session) -> None:
    session.info.pop(PENDING_KEY, None)
