"""``mongo_outbox.consumers`` mirrors ``mongo_outbox.publishers``: importing it needs neither broker
client, and each broker's module names its extra when its client is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> subprocess.CompletedProcess[str]:
    # A process of its own: this one has imported both clients already.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_importing_the_consumers_imports_no_broker_client() -> None:
    result = run(
        "import sys, mongo_outbox, mongo_outbox.consumers\n"
        "clients = {'aio_pika', 'aiormq', 'nats', 'redis'}\n"
        "assert not clients & set(sys.modules), sorted(sys.modules)\n"
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("blocked", "name", "extra"),
    [
        ("nats", "consume_nats", "mongo-outbox[nats]"),
        ("aio_pika", "handle_rabbitmq_message", "mongo-outbox[rabbitmq]"),
        ("redis", "consume_redis", "mongo-outbox[redis]"),
    ],
)
def test_a_missing_broker_client_names_its_extra(blocked: str, name: str, extra: str) -> None:
    result = run(
        f"import sys\nsys.modules[{blocked!r}] = None  # as if not installed\n"
        f"from mongo_outbox.consumers import {name}\n"
    )
    assert result.returncode == 1
    assert "ImportError" in result.stderr and extra in result.stderr


def test_the_other_broker_s_helpers_work_without_the_missing_client() -> None:
    result = run(
        "import sys\nsys.modules['nats'] = None\n"
        "from mongo_outbox.consumers import consume_rabbitmq, handle_rabbitmq_message\n"
    )
    assert result.returncode == 0, result.stderr
