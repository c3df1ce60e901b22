"""Prints the fault matrix: ``python -m tests.faults`` (or ``make faults``).

Runs tests/integration/faults/test_fault_matrix.py (extra arguments go to pytest, e.g.
``-k settle``) and prints one row per command the library sends and one column per fault class:
``holds``, ``FAILS``, ``xfail`` (a known defect, strict), ``-`` (no such cell, the reason printed
below), then the counts. ``--markdown`` prints the table as docs/failures.md has it. Exits 1 if a
cell fails.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from typing import Any

import pytest

from tests.support.faults import FAULT_NAMES

MODULE = "tests/integration/faults/test_fault_matrix.py"
CELL = re.compile(r"\[(?P<target>.+?)-(?P<fault>" + "|".join(FAULT_NAMES) + r")\]$")
SHOWN = {"passed": "holds", "failed": "FAILS", "xfailed": "xfail", "xpassed": "FAILS"}


class Collector:
    """Each cell's outcome, by command and fault class, in the order the cells ran."""

    def __init__(self) -> None:
        self.outcomes: dict[str, dict[str, str]] = defaultdict(dict)
        self.left_out: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        match = CELL.search(report.nodeid)
        if match is None:
            return
        target, fault = match["target"], match["fault"]
        if hasattr(report, "wasxfail"):
            outcome = "xpassed" if report.passed else "xfailed"
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            self.left_out[f"{target} x {fault}"] = str(reason).removeprefix("Skipped: ")
            self.outcomes[target].setdefault(fault, "-")
            return
        elif report.when != "call" and report.passed:
            return
        else:
            outcome = report.outcome
        if self.outcomes[target].get(fault) in (None, "holds"):
            self.outcomes[target][fault] = SHOWN.get(outcome, outcome)


def table(outcomes: dict[str, dict[str, str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| command | " + " | ".join(FAULT_NAMES) + " |"]
        lines.append("|---" * (len(FAULT_NAMES) + 1) + "|")
        for target, cells in outcomes.items():
            shown = [cells.get(fault, "?") for fault in FAULT_NAMES]
            lines.append(f"| `{target}` | " + " | ".join(shown) + " |")
        return lines
    width = max(len(t) for t in outcomes) if outcomes else 10
    lines = [" " * width + "  " + " ".join(f"{f:>14}" for f in FAULT_NAMES)]
    for target, cells in outcomes.items():
        row = " ".join(f"{cells.get(fault, '?'):>14}" for fault in FAULT_NAMES)
        lines.append(f"{target:<{width}}  {row}")
    return lines


def main(argv: list[str]) -> int:
    markdown = "--markdown" in argv
    extra = [a for a in argv if a != "--markdown"]
    collector = Collector()
    pytest.main([MODULE, "-q", "-n", "0", "-p", "no:cacheprovider", *extra], plugins=[collector])
    found: list[Any] = [c for cells in collector.outcomes.values() for c in cells.values()]
    counts = {name: found.count(name) for name in ("holds", "FAILS", "xfail")}
    cells = sum(counts.values())
    print()
    print("\n".join(table(collector.outcomes, markdown)))
    print()
    print(
        f"{cells} cells: {counts['holds']} hold, {counts['FAILS']} fail, "
        f"{counts['xfail']} known defects (xfail); {len(collector.left_out)} left out:"
    )
    for cell, reason in collector.left_out.items():
        print(f"  {cell}: {reason}")
    return 1 if counts["FAILS"] or not cells else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
