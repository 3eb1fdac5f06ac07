"""Alembic environment of the Health Monitor's database."""
