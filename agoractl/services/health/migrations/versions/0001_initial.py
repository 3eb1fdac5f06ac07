"""Initial schema: snapshots, presence and its history, trainer keys and sessions, contributions, alerts, flagged.

Revision ID: h0001
"""

import sqlalchemy as sa
from alembic import op

revision = "h0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("health_snapshots", sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                    sa.Column("at", sa.Float, nullable=False, index=True), sa.Column("data", sa.JSON, nullable=False))
    op.create_table("health_presence", sa.Column("node", sa.String(128), primary_key=True),
                    sa.Column("kind", sa.String(16), nullable=False), sa.Column("stage", sa.String(64)),
                    sa.Column("role", sa.String(16), nullable=False), sa.Column("phase", sa.String(16), nullable=False),
                    sa.Column("first_seen", sa.Float, nullable=False), sa.Column("last_seen", sa.Float, nullable=False),
                    sa.Column("left_at", sa.Float))
    op.create_table("health_presence_events", sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                    sa.Column("node", sa.String(128), nullable=False, index=True),
                    sa.Column("kind", sa.String(16), nullable=False), sa.Column("stage", sa.String(64)),
                    sa.Column("event", sa.String(16), nullable=False), sa.Column("at", sa.Float, nullable=False))
    op.create_table("health_trainer_keys", sa.Column("trainer", sa.Integer, primary_key=True),
                    sa.Column("key", sa.String(64), nullable=False), sa.Column("at", sa.Float, nullable=False))
    op.create_table("health_trainer_sessions", sa.Column("trainer", sa.Integer, primary_key=True),
                    sa.Column("session", sa.String(64), primary_key=True),
                    sa.Column("key", sa.String(64), nullable=False), sa.Column("peer", sa.String(128), nullable=False),
                    sa.Column("seq", sa.Integer, nullable=False), sa.Column("completed", sa.BigInteger, nullable=False),
                    sa.Column("lost", sa.BigInteger, nullable=False), sa.Column("loss_sum", sa.Float, nullable=False),
                    sa.Column("loss_samples", sa.BigInteger, nullable=False), sa.Column("loss", sa.Float),
                    sa.Column("tail_step", sa.Integer, nullable=False), sa.Column("tokens", sa.BigInteger, nullable=False),
                    sa.Column("done", sa.Boolean, nullable=False), sa.Column("first_at", sa.Float, nullable=False),
                    sa.Column("updated_at", sa.Float, nullable=False))
    op.create_table("health_contributions", sa.Column("node", sa.String(128), primary_key=True),
                    sa.Column("stage", sa.String(64), nullable=False), sa.Column("role", sa.String(16), nullable=False),
                    sa.Column("samples", sa.BigInteger, nullable=False), sa.Column("flops", sa.Float, nullable=False),
                    sa.Column("updated_at", sa.Float, nullable=False))
    op.create_table("health_alerts", sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                    sa.Column("kind", sa.String(32), nullable=False, index=True),
                    sa.Column("subject", sa.String(128), nullable=False), sa.Column("stage", sa.String(64)),
                    sa.Column("detail", sa.String(512), nullable=False),
                    sa.Column("raised_at", sa.Float, nullable=False, index=True), sa.Column("resolved_at", sa.Float))
    op.create_table("health_flagged", sa.Column("subject", sa.String(128), primary_key=True),
                    sa.Column("reason", sa.String(256), nullable=False), sa.Column("at", sa.Float, nullable=False))


def downgrade() -> None:
    for table in ("health_flagged", "health_alerts", "health_contributions", "health_trainer_sessions",
                  "health_trainer_keys", "health_presence_events", "health_presence", "health_snapshots"):
        op.drop_table(table)
