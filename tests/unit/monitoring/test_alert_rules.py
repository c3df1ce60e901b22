"""The packaged Prometheus alert rules (``mongo_outbox.monitoring.ALERTS``): ``promtool check
rules`` accepts them, their ``promtool test rules`` unit tests (alerts_test.yml, beside this
file) pass, and every alert has a unit test in which it fires.

promtool comes with Debian's ``prometheus`` package, which ``.ci/run`` installs when it is
missing. Without it these tests fail in CI (``CI`` set) and are skipped, with the reason shown,
on a developer's machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from mongo_outbox.monitoring import ALERTS

UNIT_TESTS = Path(__file__).with_name("alerts_test.yml")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_promtool_accepts_the_alert_rules(promtool: str) -> None:
    ran = run(promtool, "check", "rules", str(ALERTS))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert f"SUCCESS: {len(rules())} rules found" in ran.stdout


def test_the_alert_rules_pass_their_unit_tests(promtool: str) -> None:
    ran = run(promtool, "test", "rules", str(UNIT_TESTS))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "SUCCESS" in ran.stdout


def test_the_unit_tests_load_the_packaged_rules() -> None:
    [rule_file] = yaml.safe_load(UNIT_TESTS.read_text())["rule_files"]
    assert (UNIT_TESTS.parent / rule_file).resolve() == ALERTS.resolve()


def test_every_alert_fires_in_a_unit_test_and_stays_quiet_in_another() -> None:
    alerts = {rule["alert"] for rule in rules()}
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == alerts
    assert quiet == alerts


def test_every_alert_has_a_severity_a_summary_and_a_description() -> None:
    for rule in rules():
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
