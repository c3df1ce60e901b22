"""The packaged Grafana dashboard (``mongo_outbox.monitoring.DASHBOARD``) is a classic dashboard
JSON model that Grafana imports: a schemaVersion Grafana migrates from, panels of core types
laid out on its 24-column grid, every query on the dashboard's Prometheus data source variable.
That its queries name series live processes export is
tests/integration/observability/test_monitoring_kit.py.

Grafana migrates a dashboard whose ``schemaVersion`` lies between its
``schemaversion.MIN_VERSION`` and ``LATEST_VERSION`` up to the latest on import (grafana/grafana
apps/dashboard/pkg/migration/schemaversion/migrations.go, read at commit 01ec8e3: 9 and 42). The
dashboard is written at 39: a Grafana whose latest schema is 39 takes it as it is, newer ones
migrate it up.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from mongo_outbox.monitoring import DASHBOARD

# What Grafana puts in place of its variables before a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$relay": ".*", "$consumer": ".*"}

GRAFANA_MIN_SCHEMA = 9
GRAFANA_LATEST_SCHEMA = 42
WRITTEN_AT = 39
CORE_PANELS = {"row", "timeseries", "stat", "gauge", "table", "state-timeline", "bargauge"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_the_schema_version_is_one_grafana_imports() -> None:
    version = dashboard()["schemaVersion"]
    assert version == WRITTEN_AT
    assert GRAFANA_MIN_SCHEMA <= version <= GRAFANA_LATEST_SCHEMA


def test_the_dashboard_has_a_stable_uid_a_title_and_no_database_id() -> None:
    loaded = dashboard()
    assert loaded["uid"] == "mongo-outbox" and loaded["title"] == "mongo-outbox"
    assert "id" not in loaded  # an id belongs to one Grafana's database: import assigns one


def test_panels_are_core_types_with_unique_ids_on_the_grid_without_overlap() -> None:
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    taken: set[tuple[int, int]] = set()
    for panel in panels:
        assert panel["type"] in CORE_PANELS, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_every_query_uses_the_prometheus_data_source_variable() -> None:
    loaded = dashboard()
    [source] = [v for v in loaded["templating"]["list"] if v["name"] == "datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    for panel in loaded["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]


def test_every_variable_a_query_uses_is_defined() -> None:
    loaded = dashboard()
    defined = {v["name"] for v in loaded["templating"]["list"]}
    builtin = {"__rate_interval", "__interval", "__range"}
    for panel in loaded["panels"]:
        for target in panel.get("targets", []):
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= defined | builtin, panel["title"]


def unit_of(panel: dict[str, Any], ref: str) -> tuple[str | None, str]:
    """The unit and axis placement Grafana gives query ``ref`` of ``panel``: the panel's
    defaults, then each override that matches it by its refId."""
    config = panel.get("fieldConfig", {})
    unit = config.get("defaults", {}).get("unit")
    axis = config.get("defaults", {}).get("custom", {}).get("axisPlacement", "auto")
    for override in config.get("overrides", []):
        if override["matcher"] == {"id": "byFrameRefID", "options": ref}:
            for prop in override["properties"]:
                if prop["id"] == "unit":
                    unit = prop["value"]
                elif prop["id"] == "custom.axisPlacement":
                    axis = prop["value"]
    return unit, axis


def test_a_query_is_shown_in_seconds_exactly_when_it_measures_seconds() -> None:
    # "Checkpoint lag and recoveries" showed its count of recoveries in seconds, on the lag's
    # axis. A rate is per second ("ops"), not seconds; a histogram's buckets of seconds are.
    for panel in dashboard()["panels"]:
        axes: dict[str | None, set[str]] = {}
        for target in panel.get("targets", []):
            unit, axis = unit_of(panel, target["refId"])
            names = re.findall(r"\bmongo_outbox_[a-z_]+\b", target["expr"])
            seconds = all(re.search(r"_seconds(_bucket)?$", name) for name in names)
            rate = "rate(" in target["expr"] and "histogram_quantile" not in target["expr"]
            assert (unit == "s") == (seconds and not rate), f"{panel['title']} {target['refId']}"
            axes.setdefault(unit, set()).add(axis)
        # Two units on one panel need an axis each.
        if len(axes) > 1:
            placements = [next(iter(placed)) for placed in axes.values()]
            assert all(len(placed) == 1 for placed in axes.values()), panel["title"]
            assert len(set(placements)) == len(placements), panel["title"]


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    titles = " / ".join(p["title"] for p in dashboard()["panels"])
    for shown in (
        "Pending events",  # backlog
        "Oldest pending event age",  # its age
        "Published per second",  # publish rate
        "Publish failures per second, by reason",
        "Active relays",  # leadership
        "Group partitions with an owner",
        "Inbox outcomes per second",
        "Handler duration",
    ):
        assert shown in titles


def test_every_query_is_promql_that_promtool_accepts(promtool: str, tmp_path: Path) -> None:
    # Each query as a recording rule: ``promtool check rules`` parses its expression.
    rules = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            rules.append({"record": f"panel_{panel['id']}_{target['refId']}", "expr": expr})
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    ran = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert f"SUCCESS: {len(rules)} rules found" in ran.stdout
