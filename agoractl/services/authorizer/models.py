"""The Authorizer's durable record as SQLAlchemy 2 tables; the schema itself is made by the Alembic
migrations beside this module (never ``create_all``)."""

from __future__ import annotations

from typing import Optional

from sqlalchemy import JSON, Boolean, Float, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "accounts"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64))
    operator: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)


class Node(Base):
    __tablename__ = "nodes"
    node_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    account: Mapped[str] = mapped_column(String(64), index=True)
    operator: Mapped[bool] = mapped_column(Boolean, default=False)
    role: Mapped[str] = mapped_column(String(16))
    peer_id: Mapped[str] = mapped_column(String(128))
    stage: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    """queued, admitted, expired (not renewed), left, banned."""
    hardware: Mapped[dict] = mapped_column(JSON)
    multiaddrs: Mapped[list] = mapped_column(JSON)
    requested_at: Mapped[float] = mapped_column(Float)
    admitted_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    expires_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    serial: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    step: Mapped[int] = mapped_column(Integer, default=0)


class Decision(Base):
    __tablename__ = "decisions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[Optional[str]] = mapped_column(String(128), nullable=True, index=True)
    outcome: Mapped[str] = mapped_column(String(16))
    """admitted, queued (waiting: capacity or rate limit), refused."""
    reason: Mapped[str] = mapped_column(String(32), index=True)
    detail: Mapped[str] = mapped_column(String(256), default="")
    at: Mapped[float] = mapped_column(Float)


class Serial(Base):
    __tablename__ = "credential_serials"
    serial: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(String(128), index=True)
    issued_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)


class Ban(Base):
    __tablename__ = "bans"
    subject: Mapped[str] = mapped_column(String(128), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    """node or account."""
    reason: Mapped[str] = mapped_column(String(256), default="")
    at: Mapped[float] = mapped_column(Float)
