"""The examples, run as a user would, against the test MongoDB and the real brokers: `make demo`'s
script runs the change-stream relay through the command line while orders are saved; the cart
example writes with update operators. On a machine with nothing but Python, the demo runs in a
fresh virtual environment with the MongoDB emulator and a nats-server of its own."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from tests.support.servers import NATS_URL, MongoServer

ROOT = Path(__file__).resolve().parents[3]


def run_demo(mongo: MongoServer, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "examples/order_service.py", "--orders", "60", *args],
        cwd=ROOT,
        env=os.environ | {"MONGODB_URI": mongo.uri} | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def summary_of(stdout: str) -> dict[str, str]:
    head = stdout.split("\n\n", 1)[0]
    lines = [line.split("  ", 1) for line in head.splitlines() if "  " in line]
    return {key.strip(): value.strip() for key, value in lines}


@pytest.mark.parametrize(
    ("env", "broker"),
    [({}, "NATS JetStream"), ({"NATS_URL": "nats://127.0.0.1:1"}, "RabbitMQ")],
)
def test_the_demo_publishes_every_committed_event_live_and_ends_with_status(
    mongo: MongoServer, env: dict[str, str], broker: str
) -> None:
    result = run_demo(mongo, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary_of(result.stdout)["broker"] == broker
    assert_every_event_arrived_once_in_order(result)


def assert_every_event_arrived_once_in_order(result: subprocess.CompletedProcess[str]) -> None:
    """60 orders: the summary, the relay's log and the status that ends the demo."""
    summary = summary_of(result.stdout)
    assert summary["stale saves refused"] == "6"
    # every order placed, and every third order paid
    assert summary["events committed"] == str(60 + 20)
    assert summary["events read back from the broker"] == "80"
    assert summary["committed events missing on the broker"] == "0"
    assert summary["events on the broker that were never committed"] == "0"
    assert summary["duplicates (same id twice)"] == "0"
    assert summary["per-order sequence order held"] == "True"
    assert summary["relay exit status after SIGTERM"] == "0"
    p50 = float(summary["commit-to-broker latency p50 (ms)"])
    assert 0 < p50 <= float(summary["commit-to-broker latency max (ms)"])
    # The relay ran through the command line, and status is the last thing shown.
    assert "relay demo-relay: starting -> active" in result.stderr
    assert "SIGTERM received" in result.stderr
    status = result.stdout.split("\n\n", 1)[1]
    mode = summary["outbox mode"]
    assert status.startswith("outbox demo") and f"({mode} mode)" in status.splitlines()[0]
    assert status.splitlines()[2].split() == ["0", "-", "0"]  # nothing pending, nothing parked
    assert "demo-relay  inactive" in status and status.rstrip().endswith("none")


@pytest.mark.skipif(
    sys.version_info < (3, 13), reason="make demo runs on Python >= 3.13 (the emulator's)"
)
@pytest.mark.slow
@pytest.mark.timeout(180)  # about 25 s here; a cold pip cache or a loaded CI machine takes longer
def test_the_demo_runs_from_a_fresh_virtualenv_with_no_broker_reachable(tmp_path: Path) -> None:
    # A fresh environment with the project installed from this checkout, as the README says
    # (with the extras the demo imports). The venv is made without pip of its own: this
    # interpreter's pip installs into it (--python), which skips bootstrapping a second pip.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    python = venv / "bin" / "python"
    started = time.monotonic()
    pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]
    install = subprocess.run(
        [*pip, "install", "--quiet", f"{ROOT}[nats,rabbitmq,cli,testing]"],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    installed = time.monotonic() - started
    # No MongoDB, no broker: closed ports for both brokers, nothing on PATH but the venv and the
    # system's basics (no nats-server of the machine's), run from outside the checkout.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONGO", "PYTHON"))}
    env |= {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "NATS_URL": "nats://127.0.0.1:1",
        "RABBITMQ_URL": "amqp://g:s3cret-pw@127.0.0.1:1/",
    }
    result = subprocess.run(
        [python, ROOT / "examples" / "order_service.py", "--orders", "60"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ran = time.monotonic() - started - installed
    print(f"installed in {installed:.1f} s, the demo ran in {ran:.1f} s")
    # It said, in one line and without the password, that it started a server of its own.
    [said] = [line for line in result.stderr.splitlines() if line.startswith("no broker")]
    started_here = re.fullmatch(
        r"no broker answered at nats://127\.0\.0\.1:1 or amqp://g:\*\*\*@127\.0\.0\.1:1/: "
        r"started nats-server [\d.]+ with JetStream on port (\d+) for this run",
        said,
    )
    assert started_here
    with socket.socket() as probe:  # and stopped it at the end
        assert probe.connect_ex(("127.0.0.1", int(started_here[1]))) != 0
    assert "s3cret-pw" not in result.stderr + result.stdout
    assert summary_of(result.stdout)["broker"].startswith("NATS JetStream (nats-server ")
    assert_every_event_arrived_once_in_order(result)


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


@pytest.mark.parametrize("mode", ["collection", "embedded"])
def test_the_beanie_example_rebuilds_every_total_from_its_typed_events(
    mongo: MongoServer, mode: str
) -> None:
    result = subprocess.run(
        [sys.executable, "examples/beanie_service.py", "--orders", "20", "--mode", mode],
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
    # 20 orders placed, every third repriced (7), every second a line added (10), all but every
    # fifth paid (16).
    assert summary["events published"] == str(20 + 7 + 10 + 16)
    assert summary["orders paid"] == "16"
    assert summary["names tidied by the action"] == "True"
    assert summary["totals rebuilt from events match the orders"] == "True"
    assert summary["sequences gap-free per order"] == "True"


@pytest.mark.skipif(
    sys.version_info < (3, 13), reason="make demo runs on Python >= 3.13 (the emulator's)"
)
def test_a_demo_stopped_by_sigterm_stops_its_relay_and_removes_what_it_made(
    mongo: MongoServer,
) -> None:
    # Only Ctrl-C went through its clean-up: SIGTERM left the relay running, orphaned, and the
    # run's JetStream stream and database behind.
    with subprocess.Popen(
        [sys.executable, "examples/order_service.py", "--orders", "5000"],
        cwd=ROOT,
        env=os.environ | {"MONGODB_URI": mongo.uri, "NATS_URL": NATS_URL},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as demo:
        assert demo.stderr is not None and demo.stdout is not None
        run = relay = ""
        for line in demo.stderr:
            if found := re.search(r"change-stream relay of (demo\w+)\.outbox", line):
                run = found.group(1)
            if "starting -> active" in line:
                break
        relay = subprocess.run(
            ["pgrep", "-f", f"mongo_outbox relay .*--db {run}"], capture_output=True, text=True
        ).stdout.strip()
        assert run and relay, "the demo's relay never became active"
        demo.send_signal(signal.SIGTERM)
        try:
            assert demo.wait(60) == 130, demo.stdout.read() + demo.stderr.read()
            orphaned = pid_alive(int(relay))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(relay), signal.SIGKILL)  # whatever it left running
    assert not orphaned
    client: Any = MongoClient(mongo.uri)
    try:
        assert run not in client.list_database_names()
    finally:
        client.close()
    streams = subprocess.run(
        [sys.executable, "-c", NATS_STREAMS.replace("URL", repr(NATS_URL))],
        capture_output=True,
        text=True,
        check=True,
    )
    assert run not in streams.stdout.split()


NATS_STREAMS = """
import asyncio, nats
async def main():
    nc = await nats.connect(URL)
    print(*[s.config.name for s in await nc.jetstream().streams_info()])
    await nc.close()
asyncio.run(main())
"""


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
