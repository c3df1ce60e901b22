"""Test your own code against the MongoDB emulator mongo-outbox's own suite runs on.

::

    from pymongo import AsyncMongoClient
    from mongo_outbox.testing import start_emulator

    with start_emulator() as mongo:
        client = AsyncMongoClient(mongo.uri, tz_aware=True)
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
``MONGOECO_TRANSACTION_LIFETIME`` seconds (default 60) is aborted, as a server does.

What the emulator cannot prove; run those tests against a real replica set (a
``mongod --replSet`` in Docker, or your CI's):

- A multi-document plain write that waited for a transaction runs again from its start (MongoDB
  resumes where it waited): a non-idempotent ``update_many`` beside open transactions may change
  some documents twice.
- It reports itself standalone, so ``Inbox(transactional=None)`` picks the leased mode.
- Its change streams are its own: a replica set's oplog, elections and a real
  ``ChangeStreamHistoryLost`` are not exercised.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import timedelta
from types import TracebackType

from mongo_outbox.errors import ConfigurationError
from mongo_outbox.settings import seconds

__all__ = ["Emulator", "start_emulator"]

MODULE = "mongo_outbox.testing.emulator"


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
    limit = seconds(startup_timeout, "start_emulator.startup_timeout")
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


def _first_line(process: subprocess.Popen[str], limit: float) -> str | None:
    """The emulator's first line of output ("" if it exited), or None after ``limit`` seconds."""
    stdout = process.stdout
    assert stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(limit)
    if reader.is_alive():
        process.kill()  # its stdout closes, so the reader returns
        reader.join()
        return None
    return lines[0]


def _end(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()
