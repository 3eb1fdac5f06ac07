"""Alembic environment: runs the revisions on the connection that :func:`..db.migrate` hands over."""

from alembic import context

from agoractl.services.authorizer.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
