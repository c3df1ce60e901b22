"""Prometheus alert rules and a Grafana dashboard for the metrics of ``mongo_outbox.metrics``.

They ship inside the package so that the rules and panels an operator loads name the series the
installed version exports (docs/operating.md shows how to load them). Files, not code: nothing
here imports Prometheus or Grafana.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ALERTS", "DASHBOARD"]

_HERE = Path(__file__).resolve().parent

ALERTS = _HERE / "alerts.yml"
"""Prometheus alerting rules (a ``rule_files`` entry), checked by ``promtool``."""
DASHBOARD = _HERE / "grafana-dashboard.json"
"""A Grafana dashboard (classic JSON model, schemaVersion 39) over the same series."""
