"""webhook of a job: its URL and delivery state

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 17:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("webhook_url", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("webhook_state", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("webhook_attempts", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("webhook_lease_until", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index("ix_jobs_webhook_state", ["webhook_state"], unique=False)
    # The default filled the rows there were; new rows get theirs from the model, as every other column does.
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.alter_column("webhook_attempts", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_webhook_state")
        batch_op.drop_column("webhook_lease_until")
        batch_op.drop_column("webhook_attempts")
        batch_op.drop_column("webhook_state")
        batch_op.drop_column("webhook_url")
