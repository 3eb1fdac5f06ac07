"""Held-out evaluations (``agoractl eval FILE``) written to the Health Monitor's database, table
``health_evals``, where the Dashboard reads the latest checkpoint's validation loss."""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from agoractl.manifest.schema import Run
from agoractl.services.health.db import database_url, open_database
from agoractl.services.health.models import Eval


def record(run: Run, result: dict) -> str:
    """One row for `result` (:func:`agoractl.ops.evaluate.checkpoint_loss`); returns the database's URL."""
    engine = open_database(run)
    try:
        with Session(engine) as s:
            s.add(Eval(run=run.metadata.name, step=result["step"], loss=result["loss"],
                       perplexity=result["perplexity"], tokens=result["tokens"], at=time.time()))
            s.commit()
    finally:
        engine.dispose()
    return database_url(run)
