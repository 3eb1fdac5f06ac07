"""Initial schema: accounts, nodes, decisions, credential serials, bans.

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("accounts", sa.Column("name", sa.String(64), primary_key=True),
                    sa.Column("token_hash", sa.String(64), nullable=False),
                    sa.Column("operator", sa.Boolean, nullable=False), sa.Column("created_at", sa.Float, nullable=False))
    op.create_table("nodes", sa.Column("node_id", sa.String(128), primary_key=True),
                    sa.Column("account", sa.String(64), nullable=False, index=True),
                    sa.Column("operator", sa.Boolean, nullable=False), sa.Column("role", sa.String(16), nullable=False),
                    sa.Column("peer_id", sa.String(128), nullable=False), sa.Column("stage", sa.String(64)),
                    sa.Column("status", sa.String(16), nullable=False, index=True),
                    sa.Column("hardware", sa.JSON, nullable=False), sa.Column("multiaddrs", sa.JSON, nullable=False),
                    sa.Column("requested_at", sa.Float, nullable=False), sa.Column("admitted_at", sa.Float),
                    sa.Column("expires_at", sa.Float), sa.Column("serial", sa.Integer),
                    sa.Column("step", sa.Integer, nullable=False))
    op.create_table("decisions", sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                    sa.Column("node_id", sa.String(128), index=True), sa.Column("outcome", sa.String(16), nullable=False),
                    sa.Column("reason", sa.String(32), nullable=False, index=True),
                    sa.Column("detail", sa.String(256), nullable=False), sa.Column("at", sa.Float, nullable=False))
    op.create_table("credential_serials", sa.Column("serial", sa.Integer, primary_key=True, autoincrement=True),
                    sa.Column("node_id", sa.String(128), nullable=False, index=True),
                    sa.Column("issued_at", sa.Float, nullable=False), sa.Column("expires_at", sa.Float, nullable=False))
    op.create_table("bans", sa.Column("subject", sa.String(128), primary_key=True),
                    sa.Column("kind", sa.String(16), nullable=False), sa.Column("reason", sa.String(256), nullable=False),
                    sa.Column("at", sa.Float, nullable=False))


def downgrade() -> None:
    for table in ("bans", "credential_serials", "decisions", "nodes", "accounts"):
        op.drop_table(table)
