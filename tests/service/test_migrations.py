"""Alembic upgrades an empty database to head, and head matches the models, on PostgreSQL and SQLite."""

from collections.abc import Callable
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect

from service.migrate import alembic_config, upgrade
from service.tables import Base

pytestmark = pytest.mark.service


def check_upgrade(url: str) -> None:
    upgrade(url)
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection)
            head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
            assert context.get_current_revision() == head
            assert set(inspect(connection).get_table_names()) >= set(Base.metadata.tables)
            # Nothing the models declare is missing from (or different in) the migrated schema.
            assert compare_metadata(context, Base.metadata) == []
        command.downgrade(alembic_config(url), "base")
        with engine.connect() as connection:
            assert set(inspect(connection).get_table_names()) == {"alembic_version"}
    finally:
        engine.dispose()


def test_migrations_on_postgresql(pg_database: Callable[[], str]) -> None:
    check_upgrade(pg_database())


def test_migrations_on_sqlite(tmp_path: Path) -> None:
    check_upgrade(f"sqlite:///{tmp_path / 'casp.db'}")
