"""models from where teams keep them: a key's encrypted hub token, uploaded models

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("hub_token", sa.Text(), nullable=True))
    op.create_table(
        "uploaded_models",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner_id", sa.String(length=32), nullable=True),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("model_type", sa.String(length=32), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["owner_id"], ["api_keys.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("uploaded_models", schema=None) as batch_op:
        batch_op.create_index("ix_uploaded_models_owner_created", ["owner_id", "created_at", "id"], unique=False)
        batch_op.create_index("ix_uploaded_models_expires_at", ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("uploaded_models", schema=None) as batch_op:
        batch_op.drop_index("ix_uploaded_models_expires_at")
        batch_op.drop_index("ix_uploaded_models_owner_created")
    op.drop_table("uploaded_models")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("hub_token")
