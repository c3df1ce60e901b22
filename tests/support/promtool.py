"""promtool, for the tests of the alert rules and the dashboard's queries: Debian's
``prometheus`` package ships it, and ``.ci/run`` installs it when it is missing. Without it the
tests that need it fail in CI (``CI`` set) and are skipped, with the reason shown, on a
developer's machine."""

from __future__ import annotations

import os
import shutil

import pytest

INSTALL = "apt-get install -y --no-install-recommends prometheus"


def promtool_or_skip() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = f"promtool is not installed: {INSTALL} (Debian), as .ci/run does"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found
