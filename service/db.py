"""Engine and sessions. One engine per database URL and process."""

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


@cache
def get_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # The embedded mode shares one SQLite file between the API and worker threads: WAL lets readers
        # proceed during a write, and the busy timeout waits out a writer instead of failing at once.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


@cache
def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A unit of work: committed when the block ends normally, rolled back otherwise."""
    with session_factory(url)() as session, session.begin():
        yield session
