"""The fault matrix's parts: MongoDB's fault classes as ``failCommand`` fail points, the library's
commands they are aimed at, and the listener that arms a fail point for exactly one of them.

A fail point names commands by name only (``update``), and one relay round sends several
``update``s: its claim, its settle, the release of what waits. ``Trigger`` tells them apart by
their contents and arms the fail point the moment the client under test is about to send the one
aimed at: PyMongo tells a command listener of a command before it writes it to the socket, and
the listener configures the fail point through a client of its own (another ``appName``), so that
the server has it before the command arrives. The fail point is narrowed to the client under
test's ``appName``, so the test's own reads and writes, and every other test, go through. All of
it holds on a real replica set started with ``enableTestCommands=1``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pymongo import MongoClient, monitoring

WRITE_CONFLICT = 112
SHUTDOWN_IN_PROGRESS = 91  # retriable: on a commit, PyMongo reports UnknownTransactionCommitResult
WRITE_CONCERN_FAILED = 64
NOT_WRITABLE_PRIMARY = 10107
INTERRUPTED = 11601
REPLY_LOST_AFTER_MS = 250  # the client under test's socket timeout in the network-after cells
APPLIED_AFTER_MS = 600  # the server applies the command this long after it arrived


@dataclass(frozen=True)
class Fault:
    """One fault class: the fail point's data, and what it stands for."""

    name: str
    what: str
    data: Mapping[str, Any]
    socket_timeout_ms: int | None = None  # the client under test's, when the fault needs one
    writes_only: bool = False  # a writeConcernError alone touches only what takes a write concern
    slow: bool = False  # blockTimeMS past the lease of the command's scenario

    def fail_point(self, command: str, app: str, lease_ms: int) -> dict[str, Any]:
        data = {"failCommands": [command], "appName": app, **self.data}
        if self.slow:
            data |= {"blockConnection": True, "blockTimeMS": lease_ms + lease_ms // 2}
        return data


FAULTS = [
    Fault(
        "network-before",
        "the connection closes before the server ran the command (closeConnection)",
        {"closeConnection": True},
    ),
    Fault(
        "network-after",
        # failCommand closes before it runs the command, never after; a reply later than the
        # client's socket timeout is a network error to the client and the server runs the
        # command all the same, as when a connection drops after the server applied a write.
        "the reply is lost after the server applied the command (blockConnection past the "
        f"client's {REPLY_LOST_AFTER_MS} ms socket timeout)",
        {"blockConnection": True, "blockTimeMS": APPLIED_AFTER_MS},
        socket_timeout_ms=REPLY_LOST_AFTER_MS,
    ),
    Fault(
        "transient",
        "WriteConflict (112) labelled TransientTransactionError",
        {"errorCode": WRITE_CONFLICT, "errorLabels": ["TransientTransactionError"]},
    ),
    Fault(
        "unknown-result",
        "ShutdownInProgress (91) with the server's labels: a retryable error, and on a commit "
        "UnknownTransactionCommitResult",
        {"errorCode": SHUTDOWN_IN_PROGRESS},
    ),
    Fault(
        "write-concern",
        "the command is applied and its reply carries writeConcernError 64 (WriteConcernFailed)",
        {
            "writeConcernError": {
                "code": WRITE_CONCERN_FAILED,
                "codeName": "WriteConcernFailed",
                "errmsg": "waiting for replication timed out",
                "errInfo": {"wtimeout": True},
            }
        },
        writes_only=True,
    ),
    Fault(
        "stepdown",
        "NotWritablePrimary (10107): the primary stepped down",
        {"errorCode": NOT_WRITABLE_PRIMARY},
    ),
    Fault("interrupted", "Interrupted (11601)", {"errorCode": INTERRUPTED}),
    Fault(
        "slow",
        "the reply comes half a lease after the command's lease (blockConnection)",
        {},
        slow=True,
    ),
]
FAULT_NAMES = [fault.name for fault in FAULTS]
READS = frozenset({"find", "aggregate", "getMore"})


@dataclass(frozen=True)
class Target:
    """A command the library sends, told apart from its namesakes by ``matches``."""

    name: str
    command: str
    what: str
    matches: Callable[[Mapping[str, Any]], bool] = lambda command: True

    def applies(self, fault: Fault) -> str | None:
        """Why ``fault`` has no cell for this command, or None."""
        if fault.writes_only and self.command in READS:
            return "a read takes no write concern, so it never gets a write concern error"
        return None


def first_set(command: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``$set`` of an update command's first statement (empty for a pipeline)."""
    updates = command.get("updates") or [{}]
    change = updates[0].get("u")
    return change.get("$set", {}) if isinstance(change, Mapping) else {}


def in_collection(name: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda command: next(iter(command.values())) == name


@dataclass
class Trigger(monitoring.CommandListener):
    """Arms ``data`` with ``mode`` when the client it listens to is about to send ``target``
    (after ``arm()``), through ``admin``; counts the commands sent while the fault is on."""

    admin: MongoClient[Any]
    target: Target
    data: dict[str, Any]
    mode: Any
    armed: bool = False
    fired_at: float | None = None
    entered_before: int = 0
    hits: int | None = None  # the fail point's entries between firing and off()
    sent: int = 0  # commands the client sent between firing and off()
    after: list[str] = field(default_factory=list)  # commands sent since firing, by name
    seen: set[str] = field(default_factory=set)  # every command's name the client sent
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def arm(self) -> None:
        self.armed = True

    @property
    def fired(self) -> bool:
        return self.fired_at is not None

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        with self._lock:
            self.seen.add(event.command_name)
            if self.fired_at is not None and self.hits is None:
                self.sent += 1
                self.after.append(event.command_name)
                return
            if (
                not self.armed
                or self.fired_at is not None  # once: off() is the end of the fault
                or event.command_name != self.target.command
                or not self.target.matches(event.command)
            ):
                return
            reply = self.admin.admin.command(
                {"configureFailPoint": "failCommand", "mode": self.mode, "data": self.data}
            )
            self.entered_before = int(reply["count"])
            self.fired_at = time.monotonic()
            self.sent = 1
            self.after.append(event.command_name)

    def off(self) -> None:
        """Turn the fail point off; count the entries it had since it fired."""
        with self._lock:
            reply = self.admin.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
            if self.fired_at is not None and self.hits is None:
                self.hits = int(reply["count"]) - self.entered_before

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass
