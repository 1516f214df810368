"""the optional job.stage webhook event: the events a job's webhook receives, and one delivery per stage started

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 02:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("webhook_events", sa.JSON(), nullable=True))
    op.create_table(
        "stage_deliveries",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(length=32), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("stage_deliveries", schema=None) as batch_op:
        batch_op.create_index("ix_stage_deliveries_job_id", ["job_id"], unique=False)
        batch_op.create_index("ix_stage_deliveries_state", ["state"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("stage_deliveries", schema=None) as batch_op:
        batch_op.drop_index("ix_stage_deliveries_state")
        batch_op.drop_index("ix_stage_deliveries_job_id")
    op.drop_table("stage_deliveries")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("webhook_events")
