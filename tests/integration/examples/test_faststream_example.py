"""examples/faststream_service.py, run as a user would, on the real NATS and RabbitMQ against the
test MongoDB: every order invoiced once although the relay published everything twice, the
poison orders dead-lettered."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import MongoServer

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("broker", "name"), [("nats", "NATS JetStream"), ("rabbitmq", "RabbitMQ")])
def test_the_faststream_service_invoices_each_order_once(
    mongo: MongoServer, broker: str, name: str
) -> None:
    env = dict(os.environ)
    if mongo.kind == "emulator":
        # The example starts an emulator of its own, as it does for a user.
        env.pop("MONGODB_URI", None)
    else:
        env["MONGODB_URI"] = mongo.uri
    example = ["examples/faststream_service.py", "--orders", "20", "--broker", broker]
    try:
        result = subprocess.run(
            [sys.executable, *example],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=170,  # the example gives up by itself after about 120 s
            check=False,
        )
    except subprocess.TimeoutExpired as hung:
        log = [(out or b"").decode(errors="replace") for out in (hung.stdout, hung.stderr)]
        pytest.fail("the example hung; its output so far:\n" + "\n".join(log))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.split("  ", 1) for line in result.stdout.splitlines() if "  " in line]
    summary = {key.strip(): value.strip() for key, value in lines}
    assert summary == {
        "broker": name,
        "orders saved": "20",
        "events published": "40",  # everything twice, as after a relay crash
        "invoices written": "18",
        "orders invoiced twice": "0",
        "dead-lettered": "2",  # orders 9 and 19
    }, result.stderr
