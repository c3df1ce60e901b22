"""examples/django_shop, run as a user would against the test MongoDB: Django migrates its app,
the orders are saved with their events, a refused order and a rolled-back payment leave
nothing, and the relay publishes exactly the events of what was stored. docs/django.md shows
the example's files: its blocks must still be their lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import MongoServer

pytest.importorskip("django_mongodb_backend", reason="the django extra is not installed")

ROOT = Path(__file__).resolve().parents[3]
FROM_FILE = re.compile(r"<!-- not-tested: (examples/\S+), [^>]*-->\s*```python\n(.*?)```", re.S)


@pytest.mark.slow  # a Python process that imports Django, migrates and relays: about 4 s
@pytest.mark.timeout(200)
def test_the_django_shop_saves_orders_with_their_events_and_relays_them(mongo: MongoServer) -> None:
    env = dict(os.environ, MONGODB_URI=mongo.uri)
    result = subprocess.run(
        [sys.executable, "examples/django_shop/run.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.split(None, 1) for line in result.stdout.splitlines()]
    published = [line[1].split() for line in lines if line[0] == "published"]
    summary = {key: value for key, value in lines if key != "published"}
    assert summary == {
        "refused": "Ensure this value is greater than or equal to 0.",
        "aborted": "the card was declined after all",
        "orders": "2",
        "payments": "1",
        "ada": "paid 2",
    }, result.stdout
    paid = [line for line in published if line[0] == "order.paid"]
    assert len(paid) == 1 and len(published) == 3, published
    ada = paid[0][1]
    (bob,) = {line[1] for line in published} - {ada}
    # Each aggregate's events in their order; the two aggregates in any order.
    assert [line for line in published if line[1] == ada] == [
        ["order.placed", ada, "1"],
        ["order.paid", ada, "2"],
    ]
    assert [line for line in published if line[1] == bob] == [["order.placed", bob, "1"]]


def test_the_docs_show_the_example_files_as_they_are() -> None:
    text = (ROOT / "docs" / "django.md").read_text()
    shown = FROM_FILE.findall(text)
    assert len(shown) >= 2
    for path, block in shown:
        assert block in (ROOT / path).read_text(), f"docs/django.md no longer shows {path}"
