"""per-key fair-use limits; artifact retention of jobs

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 17:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_active_jobs", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_submissions_per_minute", sa.Integer(), nullable=True))
    # Jobs of before have no expiry: their artifacts stay until deleted, as they were promised.
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("retention_seconds", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index("ix_jobs_expires_at", ["artifacts_deleted", "expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_expires_at")
        batch_op.drop_column("expires_at")
        batch_op.drop_column("retention_seconds")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("max_submissions_per_minute")
        batch_op.drop_column("max_active_jobs")
