"""The conformance report: how many spec tests passed, and each one not run with its reason.

Printed at the end of any run that includes ``tests/conformance`` (by the controller of a run on
workers, ``pytest -n``, from the reports and notes they send it; tests/conftest.py registers this
module); ``CONFORMANCE_REPORT=path`` also writes it to that file. Skips are grouped per spec
file when every test of a file was skipped for the same reason.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.specs import NOTES

SUITES = {"transactions-convenient-api": "transactions"}
OUTCOMES: dict[str, tuple[str, str]] = {}  # test key -> (outcome, reason)
SECONDS = [0.0]  # setup, call and teardown of every spec test


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "_specs.py::test_spec[" not in report.nodeid:
        return
    key = report.nodeid.split("[", 1)[1].rsplit("]", 1)[0]
    SECONDS[0] += report.duration
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "XPASS"
            OUTCOMES[key] = (outcome, str(report.wasxfail))
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            OUTCOMES[key] = ("skipped", reason.removeprefix("Skipped: "))
        else:
            OUTCOMES[key] = (report.outcome, "" if report.passed else str(report.longrepr)[-300:])


def report_lines() -> list[str]:
    # One line per suite: the transactions files together, the others each by their folder.
    tallies: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for key, (outcome, _) in OUTCOMES.items():
        folder = key.split("/", 1)[0]
        tallies[SUITES.get(folder, folder)][outcome] += 1
    lines = [
        f"MongoDB {suite} specification tests: "
        + ", ".join(f"{count} {outcome}" for outcome, count in sorted(tally.items()))
        + f" of {sum(tally.values())}"
        for suite, tally in sorted(tallies.items())
    ]
    lines.append(f"(all spec tests: {SECONDS[0]:.1f} s)")
    lines += [f"note: {note}" for note in sorted(NOTES)]
    by_file: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    for key, (outcome, reason) in sorted(OUTCOMES.items()):
        spec_file, _, description = key.partition(": ")
        by_file[spec_file].append((description, outcome, reason))
    for title, wanted in (
        ("skipped", {"skipped"}),
        ("xfailed (known emulator differences)", {"xfailed", "XPASS"}),
        ("failed", {"failed"}),
    ):
        entries = []
        for spec_file, tests in by_file.items():
            hits = [test for test in tests if test[1] in wanted]
            reasons = {reason for _, _, reason in hits}
            if hits and len(hits) == len(tests) and len(reasons) == 1:
                entries.append(f"  {spec_file} (all {len(hits)}): {reasons.pop()}")
                continue
            entries += [f"  {spec_file}: {d} [{o}]: {r}" for d, o, r in hits]
        if entries:
            lines += [f"{title}:", *entries]
    return lines


def pytest_sessionfinish(session: pytest.Session) -> None:
    # A worker of `pytest -n` hands its notes to the controller, which prints the report.
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["conformance_notes"] = sorted(NOTES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    NOTES.update(getattr(node, "workeroutput", {}).get("conformance_notes", ()))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not OUTCOMES:
        return
    lines = report_lines()
    terminalreporter.section("conformance")
    for line in lines:
        terminalreporter.write_line(line)
    target = os.environ.get("CONFORMANCE_REPORT")
    if target:
        Path(target).write_text("\n".join(lines) + "\n")
