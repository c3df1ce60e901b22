"""promtool, for the alert rules' and the dashboard's tests (tests/support/promtool.py)."""

from __future__ import annotations

import pytest

from tests.support.promtool import promtool_or_skip


@pytest.fixture(scope="module")
def promtool() -> str:
    return promtool_or_skip()
