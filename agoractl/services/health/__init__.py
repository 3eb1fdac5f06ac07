"""The Health Monitor (report §3.6.2): a utility node that reads the run's DHT records on an interval and keeps
their history in a database (presence, verified trainer progress counted once, FLOPs contributed, alerts).
Imported only by ``agoractl launch health`` and ``agoractl status`` (it needs the ``services`` extra)."""

from pathlib import Path

RULES = Path(__file__).with_name("alerts.rules.yml")
"""The Prometheus alert rules shipped with the package (tested by tests/services/health/test_alert_rules.py)."""
