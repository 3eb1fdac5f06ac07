"""The Authorizer (report §3.6.1): admits nodes to a run, places workers on stages, issues credentials.

PostgreSQL (SQLAlchemy 2, Alembic migrations) is the durable record; Redis holds the join queue, the rate
limiter, the capacity counters and the live policy. Without URLs it runs on SQLite and in-process state.
Start it with ``agoractl launch authorizer FILE``.
"""
