"""The Health Monitor's database as SQLAlchemy 2 tables; the schema is made by the Alembic migrations beside
this module (never ``create_all``). Times are wall-clock seconds (``time.time()``). Every row names its run
(``metadata.name``): one database may hold several runs."""

from __future__ import annotations

from typing import Optional

from sqlalchemy import JSON, BigInteger, Boolean, Float, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Snapshot(Base):
    """One interval's read of the run: per stage workers by phase, step; per trainer its latest report."""

    __tablename__ = "health_snapshots"
    run: Mapped[str] = mapped_column(String(64), index=True, default="")
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float, index=True)
    data: Mapped[dict] = mapped_column(JSON)


class Presence(Base):
    """A node's presence: first and last time seen in the DHT, and when it left (None while present)."""

    __tablename__ = "health_presence"
    run: Mapped[str] = mapped_column(String(64), index=True, default="")
    node: Mapped[str] = mapped_column(String(128), primary_key=True)
    """Its peer id."""
    kind: Mapped[str] = mapped_column(String(16))
    """worker or trainer."""
    stage: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    role: Mapped[str] = mapped_column(String(16), default="")
    phase: Mapped[str] = mapped_column(String(16), default="")
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
    left_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)


class PresenceEvent(Base):
    """joined / left, one row per change: the presence history (kept after the node's record expired)."""

    __tablename__ = "health_presence_events"
    run: Mapped[str] = mapped_column(String(64), index=True, default="")
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    stage: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    event: Mapped[str] = mapped_column(String(16))
    at: Mapped[float] = mapped_column(Float)


class TrainerKey(Base):
    """The node key a trainer index first reported under (trust on first use): another key is a forgery."""

    __tablename__ = "health_trainer_keys"
    run: Mapped[str] = mapped_column(String(64), primary_key=True, default="")
    trainer: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    key: Mapped[str] = mapped_column(String(64))
    at: Mapped[float] = mapped_column(Float)


class TrainerSession(Base):
    """A trainer process's verified progress: cumulative counts from its newest counted report."""

    __tablename__ = "health_trainer_sessions"
    run: Mapped[str] = mapped_column(String(64), index=True, default="")
    trainer: Mapped[int] = mapped_column(Integer, primary_key=True)
    session: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(64))
    peer: Mapped[str] = mapped_column(String(128))
    seq: Mapped[int] = mapped_column(Integer)
    """Newest report counted; a report with seq <= this is discarded."""
    completed: Mapped[int] = mapped_column(BigInteger, default=0)
    lost: Mapped[int] = mapped_column(BigInteger, default=0)
    loss_sum: Mapped[float] = mapped_column(Float, default=0.0)
    loss_samples: Mapped[int] = mapped_column(BigInteger, default=0)
    loss: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    """The newest report's recent mean loss."""
    tail_step: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    done: Mapped[bool] = mapped_column(Boolean, default=False)
    first_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class Contribution(Base):
    """A worker's contributed compute: samples it trained (its own cumulative count) x its stage's FLOPs."""

    __tablename__ = "health_contributions"
    run: Mapped[str] = mapped_column(String(64), index=True, default="")
    node: Mapped[str] = mapped_column(String(128), primary_key=True)
    stage: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16), default="")
    samples: Mapped[int] = mapped_column(BigInteger, default=0)
    flops: Mapped[float] = mapped_column(Float, default=0.0)
    updated_at: Mapped[float] = mapped_column(Float)


class Alert(Base):
    """A check that failed: raised when the condition begins, resolved when it ends."""

    __tablename__ = "health_alerts"
    run: Mapped[str] = mapped_column(String(64), index=True, default="")
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)
    subject: Mapped[str] = mapped_column(String(128))
    """What it is about: a peer id, a stage, a trainer key, or the run."""
    stage: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    detail: Mapped[str] = mapped_column(String(512), default="")
    raised_at: Mapped[float] = mapped_column(Float, index=True)
    resolved_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)


class Flagged(Base):
    """Subjects excluded from the aggregates (forgers), by trainer key or peer id."""

    __tablename__ = "health_flagged"
    subject: Mapped[str] = mapped_column(String(128), primary_key=True)
    reason: Mapped[str] = mapped_column(String(256))
    at: Mapped[float] = mapped_column(Float)


class Eval(Base):
    """Validation loss and perplexity of a checkpoint on held-out shards."""

    __tablename__ = "health_evals"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run: Mapped[str] = mapped_column(String(64), index=True)
    step: Mapped[int] = mapped_column(Integer)
    """The checkpoint's step."""
    loss: Mapped[float] = mapped_column(Float)
    perplexity: Mapped[float] = mapped_column(Float)
    tokens: Mapped[int] = mapped_column(BigInteger)
    """Held-out tokens scored."""
    at: Mapped[float] = mapped_column(Float)
