"""jobs.dispatched_at: whether a queued job's message reached the broker

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 11:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True))
    # Jobs queued before this column were sent when created: the reaper checks the broker still holds them.
    op.execute("UPDATE jobs SET dispatched_at = created_at WHERE status = 'queued'")


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("dispatched_at")
