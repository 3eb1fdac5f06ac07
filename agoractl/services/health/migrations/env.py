"""Alembic environment: runs the revisions on the connection that :func:`..db.migrate` hands over. Its own
version table, so the monitor can share a database with the Authorizer."""

from alembic import context

from agoractl.services.health.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True,
                  version_table="health_alembic_version")
with context.begin_transaction():
    context.run_migrations()
