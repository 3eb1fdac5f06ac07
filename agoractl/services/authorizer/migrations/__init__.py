"""Alembic migrations of the Authorizer's database (run by :func:`agoractl.services.authorizer.db.migrate`)."""
