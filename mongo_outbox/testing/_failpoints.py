"""MongoDB's ``failCommand`` fail point, for the emulator: the faults drivers test with.

``db.adminCommand({configureFailPoint: "failCommand", mode, data})`` as on a server started with
``enableTestCommands``. The fail point is server-wide: it hits the matching commands of every
connection, not only the one that set it (``data.appName`` narrows it to one client's). What a
hit does, in the server's order (``CommandHelpers::evaluateFailCommandFailPoint``):

- ``blockConnection`` with ``blockTimeMS``: the command waits that long first, then goes on;
- ``closeConnection``: the server hangs up without a reply and runs nothing;
- ``errorCode``: the reply is ``{ok: 0, code, codeName, errmsg, errorLabels}``, the command not
  run; without ``errorLabels`` the labels are the ones a server adds to that code there
  (``TransientTransactionError`` in a transaction, ``RetryableWriteError`` on a retryable
  write, a commit or an abort; never ``ResumableChangeStreamError``: the fail point hits
  before the server knows the command is a change stream's);
- ``writeConcernError`` alone: the write is applied, and its reply (ok: 1) carries that
  ``writeConcernError``; it hits only commands that take a write concern.

``mode`` is ``"alwaysOn"``, ``"off"``, ``{times: n}`` (the next n hits, then off), ``{skip: n}``
(the first n matching commands go through, every later one is hit) or
``{activationProbability: p}``. A command that does not match (another name, another
``appName``) neither counts nor is skipped. The reply to ``configureFailPoint`` has ``count``,
the times the fail point was hit so far. ``configureFailPoint`` itself is never hit.

``failGetMoreAfterCursorCheckout`` (``data.errorCode``, the same modes) fails a change
stream's ``getMore`` once its cursor is found: the error then carries the server's
``ResumableChangeStreamError`` for the codes a stream resumes after, as MongoDB's does. (A
driver resumes after that label alone, or a network or "not primary" error.)

The emulator evaluates it before anything else of the command (the transaction checks
included), so a commit hit by an error is still pending and a retried commit runs it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

FAIL_COMMAND = "failCommand"
AFTER_CURSOR_CHECKOUT = "failGetMoreAfterCursorCheckout"
BAD_VALUE = 2
FAIL_POINT_SET_FAILED = 9998  # FailPointSetFailed, a fail point other than failCommand

# The server's codeName of the codes a test is likely to inject (the reply carries it).
CODE_NAMES = {
    2: "BadValue",
    6: "HostUnreachable",
    7: "HostNotFound",
    11: "UserNotFound",
    24: "LockTimeout",
    43: "CursorNotFound",
    50: "MaxTimeMSExpired",
    64: "WriteConcernFailed",
    89: "NetworkTimeout",
    91: "ShutdownInProgress",
    100: "UnsatisfiableWriteConcern",
    112: "WriteConflict",
    133: "FailedToSatisfyReadPreference",
    134: "ReadConcernMajorityNotAvailableYet",
    189: "PrimarySteppedDown",
    234: "RetryChangeStream",
    246: "SnapshotUnavailable",
    267: "PreparedTransactionInProgress",
    251: "NoSuchTransaction",
    262: "ExceededTimeLimit",
    280: "ChangeStreamFatalError",
    286: "ChangeStreamHistoryLost",
    9001: "SocketException",
    10107: "NotWritablePrimary",
    11600: "InterruptedAtShutdown",
    11601: "Interrupted",
    11602: "InterruptedDueToReplStateChange",
    13435: "NotPrimaryNoSecondaryOk",
    13436: "NotPrimaryOrSecondary",
}
# ErrorCodes::isRetriableError: a retryable write, a commit or an abort that failed with one
# of these is labelled RetryableWriteError; another command of a transaction,
# TransientTransactionError.
RETRIABLE = frozenset(
    {
        6,  # HostUnreachable
        7,  # HostNotFound
        89,  # NetworkTimeout
        91,  # ShutdownInProgress
        134,  # ReadConcernMajorityNotAvailableYet
        189,  # PrimarySteppedDown
        262,  # ExceededTimeLimit
        9001,  # SocketException
        10107,  # NotWritablePrimary
        11600,  # InterruptedAtShutdown
        11602,  # InterruptedDueToReplStateChange
        13435,  # NotPrimaryNoSecondaryOk
        13436,  # NotPrimaryOrSecondary
    }
)
# Transient in a transaction whatever the command, its commit and abort included
# (isTransientTransactionError: these, snapshot errors, and the need to retarget).
TRANSIENT_IN_TRANSACTION = frozenset(
    {
        24,  # LockTimeout
        63,  # StaleShardVersion
        112,  # WriteConflict
        150,  # StaleEpoch
        239,  # SnapshotTooOld
        246,  # SnapshotUnavailable
        249,  # StaleDbVersion
        267,  # PreparedTransactionInProgress
        308,  # MigrationConflict
        311,  # StaleChunkHistory
        13388,  # StaleConfig
    }
)
NO_SUCH_TRANSACTION = 251
# A change stream's aggregate or getMore that failed with these can be resumed.
# (isResumableChangeStreamError: the retriable ones, FailedToSatisfyReadPreference,
# RetryChangeStream, and the stale shard versions StaleShardVersion, StaleEpoch, StaleConfig.)
RESUMABLE = RETRIABLE | {133, 234, 63, 150, 13388}
ENDS_TRANSACTION = frozenset({"commitTransaction", "abortTransaction"})
# The commands that take a write concern: a writeConcernError alone hits only these.
WRITES = frozenset(
    {
        "insert", "update", "delete", "findAndModify", "findandmodify", "bulkWrite",
        "commitTransaction", "abortTransaction", "create", "createIndexes", "drop",
        "dropDatabase", "dropIndexes", "renameCollection", "collMod",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Hit:
    """What the fail point does to one command."""

    block_ms: int
    close_connection: bool
    error_code: int | None
    error_labels: list[str] | None  # None: the labels a server would add
    write_concern_error: dict[str, Any] | None
    in_cursor: bool = False  # failGetMoreAfterCursorCheckout: the getMore found its cursor

    def error_reply(self, body: dict[str, Any], change_stream: bool) -> dict[str, Any]:
        assert self.error_code is not None
        code = self.error_code
        reply: dict[str, Any] = {
            "ok": 0.0,
            "errmsg": "Failing command via 'failCommand' failpoint",
            "code": code,
            "codeName": CODE_NAMES.get(code, f"Location{code}"),
        }
        labels = self.error_labels
        if labels is None:
            labels = server_labels(body, code, change_stream=change_stream)
        if labels:
            reply["errorLabels"] = list(labels)
        return reply

    def add_write_concern_error(self, body: dict[str, Any], reply: dict[str, Any]) -> None:
        assert self.write_concern_error is not None
        reply["writeConcernError"] = dict(self.write_concern_error)
        labels = self.error_labels
        if labels is None:
            code = self.write_concern_error.get("code")
            labels = []
            if isinstance(code, int) and code in RETRIABLE and _retryable_write(body):
                labels = ["RetryableWriteError"]
        if labels:
            reply["errorLabels"] = list(labels)


def server_labels(body: dict[str, Any], code: int, *, change_stream: bool) -> list[str]:
    """The labels a server (4.4 and later) adds to an error reply: ``ErrorLabelBuilder``."""
    name = _command_name(body)
    labels = []
    if body.get("autocommit") is False:
        # A commit or abort is retried on its own after a retriable error; any other command
        # makes the whole transaction retried.
        others = {NO_SUCH_TRANSACTION}
        if name not in ENDS_TRANSACTION:
            others |= RETRIABLE
        if code in TRANSIENT_IN_TRANSACTION or code in others:
            labels.append("TransientTransactionError")
    if code in RETRIABLE and _retryable_write(body):
        labels.append("RetryableWriteError")
    if change_stream and name in ("aggregate", "getMore") and code in RESUMABLE:
        labels.append("ResumableChangeStreamError")
    return labels


def _retryable_write(body: dict[str, Any]) -> bool:
    """A commit, an abort, or a write the driver sent with a txnNumber outside a transaction."""
    name = _command_name(body)
    if name in ENDS_TRANSACTION:
        return True
    return name in WRITES and "txnNumber" in body and body.get("autocommit") is not False


def _command_name(body: dict[str, Any]) -> str:
    return next((key for key in body if not key.startswith("$")), "")


class FailPoints:
    """The server's ``failCommand`` fail point: configured by ``configureFailPoint``, consulted
    for every other command."""

    def __init__(self, chance: random.Random | None = None, name: str = FAIL_COMMAND) -> None:
        self.name = name
        self.data: dict[str, Any] | None = None  # None: off
        self.mode: str = "off"  # "alwaysOn" | "times" | "skip" | "activationProbability"
        self.value: float = 0
        self.entered = 0  # times hit, over every configuration (the reply's count)
        self.chance = chance or random.Random()

    def configure(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("configureFailPoint")
        if name != self.name:
            return _refusal(
                FAIL_POINT_SET_FAILED,
                "FailPointSetFailed",
                f"the emulator has only the {FAIL_COMMAND} and {AFTER_CURSOR_CHECKOUT} fail "
                f"points, not {name!r}",
            )
        mode = body.get("mode")
        data = body.get("data")
        if mode == "off":
            self.data, self.mode = None, "off"
            return {"count": self.entered, "ok": 1.0}
        if not isinstance(data, dict):
            return _refusal(BAD_VALUE, "BadValue", "failCommand needs a data document")
        value: Any
        if mode == "alwaysOn":
            kind, value = "alwaysOn", 0.0
        elif isinstance(mode, dict) and len(mode) == 1:
            kind, raw = next(iter(mode.items()))
            value = getattr(raw, "value", raw)  # mongoeco decodes an Int64 to its BsonInt64
            if kind in ("times", "skip"):
                valid = isinstance(value, int) and value >= 0
            else:
                valid = kind == "activationProbability" and isinstance(value, int | float)
                valid = valid and 0 <= value <= 1
            if not valid or isinstance(value, bool):
                return _refusal(BAD_VALUE, "BadValue", f"invalid fail point mode {mode!r}")
        else:
            return _refusal(BAD_VALUE, "BadValue", f"invalid fail point mode {mode!r}")
        self.data, self.mode, self.value = dict(data), kind, float(value)
        if kind == "times" and value == 0:
            self.data, self.mode = None, "off"
        return {"count": self.entered, "ok": 1.0}

    def hit(self, body: dict[str, Any], app_name: str | None) -> Hit | None:
        """What the fail point does to this command, or None; a hit is counted."""
        data = self.data
        if data is None:
            return None
        name = _command_name(body)
        hits = data.get("failCommands") if self.name == FAIL_COMMAND else ["getMore"]
        if name == "configureFailPoint" or name not in (hits or ()):
            return None
        if "appName" in data and data["appName"] != app_name:
            return None
        close = bool(data.get("closeConnection"))
        code = data.get("errorCode")
        wce: dict[str, Any] | None = data.get("writeConcernError")
        block = int(data.get("blockTimeMS", 0)) if data.get("blockConnection") else 0
        # A writeConcernError alone touches only the commands that take a write concern; with
        # nothing to do the fail point is not entered.
        only_wce = not close and code is None and wce is not None
        if (only_wce and name not in WRITES) or not (close or code is not None or wce or block):
            return None
        if not self._fires():
            return None
        self.entered += 1
        labels = data.get("errorLabels")
        return Hit(
            block_ms=block,
            close_connection=close,
            error_code=None if close or code is None else int(code),
            error_labels=None if labels is None else [str(label) for label in labels],
            write_concern_error=dict(wce) if only_wce and wce is not None else None,
            in_cursor=self.name == AFTER_CURSOR_CHECKOUT,
        )

    def _fires(self) -> bool:
        if self.mode == "alwaysOn":
            return True
        if self.mode == "times":
            self.value -= 1
            if self.value <= 0:
                self.data, self.mode = None, "off"
            return True
        if self.mode == "skip":
            if self.value <= 0:
                return True
            self.value -= 1
            return False
        return self.chance.random() < self.value  # activationProbability


def _refusal(code: int, name: str, message: str) -> dict[str, Any]:
    return {"ok": 0.0, "code": code, "codeName": name, "errmsg": message}
