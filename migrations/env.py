"""Alembic environment: the URL is the one the service uses unless the caller set sqlalchemy.url."""

from alembic import context
from sqlalchemy import create_engine

from service.settings import Settings
from service.tables import Base

config = context.config
url = config.get_main_option("sqlalchemy.url") or Settings().database


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(url)
    with engine.connect() as connection:
        # Batch mode: SQLite can only ALTER a table by copying it, and later migrations must work there too.
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
