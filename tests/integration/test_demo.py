"""The examples, run as a user would, against the test MongoDB (and, for `make demo`'s script,
the real brokers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import MongoServer

ROOT = Path(__file__).resolve().parents[2]


def run_demo(mongo: MongoServer, *args: str, **env: str) -> dict[str, str]:
    result = subprocess.run(
        [sys.executable, "examples/order_service.py", "--orders", "60", *args],
        cwd=ROOT,
        env=os.environ | {"MONGODB_URI": mongo.uri} | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.split("  ", 1) for line in result.stdout.splitlines() if "  " in line]
    return {key.strip(): value.strip() for key, value in lines}


@pytest.mark.parametrize(
    ("args", "env", "broker"),
    [
        ((), {}, "NATS JetStream"),
        (("--mode", "embedded"), {"NATS_URL": "nats://127.0.0.1:1"}, "RabbitMQ"),
        (
            (),
            {"NATS_URL": "nats://127.0.0.1:1", "RABBITMQ_URL": "amqp://g:g@127.0.0.1:1/"},
            "memory (no broker answered)",
        ),
    ],
)
def test_demo_publishes_every_committed_event_and_nothing_else(
    mongo: MongoServer, args: tuple[str, ...], env: dict[str, str], broker: str
) -> None:
    summary = run_demo(mongo, *args, **env)
    assert summary["broker"] == broker
    assert summary["orders saved"] == "54"
    assert summary["transactions aborted on purpose"] == "6"
    committed = int(summary["events committed"])
    # every saved order placed, and every third order paid unless its placing was aborted (9, 39)
    assert committed == 54 + 20 - 2
    assert summary["events read back from the broker"] == str(committed)
    assert summary["committed events missing on the broker"] == "0"
    assert summary["events on the broker that were never committed"] == "0"
    assert summary["per-order sequence order held"] == "True"


@pytest.mark.parametrize("mode", ["collection", "embedded"])
def test_the_cart_example_rebuilds_every_total_from_its_typed_events(
    mongo: MongoServer, mode: str
) -> None:
    result = subprocess.run(
        [sys.executable, "examples/cart_service.py", "--carts", "20", "--mode", mode],
        cwd=ROOT,
        env=os.environ | {"MONGODB_URI": mongo.uri},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.split("  ", 1) for line in result.stdout.splitlines() if "  " in line]
    summary = {key.strip(): value.strip() for key, value in lines}
    # 20 carts: opened, 2 items each, every third a mug added and the pens removed, every fifth
    # abandoned and the rest checked out; collection mode also reserves stock per item added.
    added = 20 * 2 + 7
    events = 20 + added + 7 + 20
    if mode == "collection":
        events += added
    assert summary["events published"] == str(events)
    assert summary["carts checked out"] == "16"
    assert summary["abandoned carts left"] == "0"
    assert summary["totals rebuilt from events match the carts"] == "True"
    assert summary["sequences gap-free per cart"] == "True"
