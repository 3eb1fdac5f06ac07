"""Runs: every row names the run it belongs to (``metadata.name``), so one database can hold several runs (the
Dashboard shows them side by side); trainer keys are per run; held-out evaluations of checkpoints.

Rows written before this revision get run ''; a monitor adopts them as its own run's at start.

Revision ID: h0002
"""

import sqlalchemy as sa
from alembic import op

revision = "h0002"
down_revision = "h0001"
branch_labels = None
depends_on = None

TABLES = ("health_snapshots", "health_presence", "health_presence_events", "health_trainer_sessions",
          "health_contributions", "health_alerts")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as b:
            b.add_column(sa.Column("run", sa.String(64), nullable=False, server_default=""))
        op.create_index(f"ix_{table}_run", table, ["run"])
    # Trainer indices repeat across runs: the key table's primary key becomes (run, trainer).
    op.rename_table("health_trainer_keys", "health_trainer_keys_h0001")
    op.create_table("health_trainer_keys", sa.Column("run", sa.String(64), primary_key=True, server_default=""),
                    sa.Column("trainer", sa.Integer, primary_key=True, autoincrement=False),
                    sa.Column("key", sa.String(64), nullable=False), sa.Column("at", sa.Float, nullable=False))
    op.execute("INSERT INTO health_trainer_keys (run, trainer, key, at) "
               "SELECT '', trainer, key, at FROM health_trainer_keys_h0001")
    op.drop_table("health_trainer_keys_h0001")
    op.create_table("health_evals", sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                    sa.Column("run", sa.String(64), nullable=False, index=True),
                    sa.Column("step", sa.Integer, nullable=False), sa.Column("loss", sa.Float, nullable=False),
                    sa.Column("perplexity", sa.Float, nullable=False), sa.Column("tokens", sa.BigInteger, nullable=False),
                    sa.Column("at", sa.Float, nullable=False))


def downgrade() -> None:
    op.drop_table("health_evals")
    op.rename_table("health_trainer_keys", "health_trainer_keys_h0002")
    op.create_table("health_trainer_keys", sa.Column("trainer", sa.Integer, primary_key=True),
                    sa.Column("key", sa.String(64), nullable=False), sa.Column("at", sa.Float, nullable=False))
    op.execute("INSERT INTO health_trainer_keys (trainer, key, at) SELECT trainer, MIN(key), MIN(at) "
               "FROM health_trainer_keys_h0002 GROUP BY trainer")
    op.drop_table("health_trainer_keys_h0002")
    for table in TABLES:
        op.drop_index(f"ix_{table}_run", table)
        with op.batch_alter_table(table) as b:
            b.drop_column("run")
