"""presigned model uploads: the uploads handed out and not yet completed

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 02:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pending_uploads",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner_id", sa.String(length=32), nullable=True),
        sa.Column("name", sa.String(length=100), nullable=True),
        sa.Column("retention_seconds", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["owner_id"], ["api_keys.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("pending_uploads", schema=None) as batch_op:
        batch_op.create_index("ix_pending_uploads_expires_at", ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("pending_uploads", schema=None) as batch_op:
        batch_op.drop_index("ix_pending_uploads_expires_at")
    op.drop_table("pending_uploads")
