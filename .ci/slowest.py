"""Print the slowest tests of each leg's JUnit XML report, and any test that failed first and
passed on a rerun (a flake, though the run is green: .ci/run uses no reruns today, so this
stays empty unless one is added).

Usage: python .ci/slowest.py COUNT LABEL=REPORT.xml [LABEL=REPORT.xml ...]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(count: int, reports: list[str]) -> None:
    for spec in reports:
        label, _, path = spec.partition("=")
        try:
            cases = ET.parse(path).getroot().iter("testcase")
        except (OSError, ET.ParseError) as error:
            print(f"{label}: no report ({error})")
            continue
        timed = []
        reruns = []
        for case in cases:
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            timed.append((float(case.get("time") or 0), name))
            if case.find("rerunFailure") is not None or case.find("flakyFailure") is not None:
                reruns.append(name)
        print(f"{label}: the {count} slowest of {len(timed)} tests")
        for seconds, name in sorted(timed, reverse=True)[:count]:
            print(f"  {seconds:7.2f}s  {name}")
        print(f"{label}: passed only on a rerun: {', '.join(reruns) or 'none'}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
