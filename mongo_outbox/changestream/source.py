"""Where a change-stream relay's changes come from: the ``ChangeSource`` protocol, its PyMongo
and Motor adapter ``WatchSource``, and the triage of change-stream errors.

Every server code the triage branches on is named, as PyMongo's own ``change_stream.py`` names
them. ``resume`` errors resume from the token after a backoff, ``recover`` errors mean the token
is unusable (the relay sweeps the outbox and watches from a fresh cluster time), ``fatal`` ones
no retry can fix.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol

from pymongo.errors import ConnectionFailure, OperationFailure, PyMongoError

from mongo_outbox.outbox import Outbox

HISTORY_LOST = 286  # ChangeStreamHistoryLost: the oplog no longer holds the token
INVALID_RESUME_TOKEN = 260  # InvalidResumeToken
CHANGE_STREAM_FATAL = 280  # ChangeStreamFatalError: servers before 4.2 answer a lost token so
_RECOVER_CODES = frozenset({HISTORY_LOST, INVALID_RESUME_TOKEN, CHANGE_STREAM_FATAL})
# Servers before 4.4 send these without the ResumableChangeStreamError label (driver spec).
_RESUMABLE_CODES = frozenset(
    {
        6,  # HostUnreachable
        7,  # HostNotFound
        43,  # CursorNotFound
        63,  # StaleShardVersion
        89,  # NetworkTimeout
        91,  # ShutdownInProgress
        133,  # FailedToSatisfyReadPreference
        150,  # StaleEpoch
        189,  # PrimarySteppedDown
        234,  # RetryChangeStream
        262,  # ExceededTimeLimit
        9001,  # SocketException
        10107,  # NotWritablePrimary
        11600,  # InterruptedAtShutdown
        11602,  # InterruptedDueToReplStateChange
        13388,  # StaleConfig
        13435,  # NotPrimaryNoSecondaryOk
        13436,  # NotPrimaryOrSecondary
    }
)
# No change-stream rule resumes on these, yet a retry fixes them: an operation killed (killOp,
# killSessions, a server's own interruption) or a conflict. They ended the relay for good.
_TRANSIENT_CODES = frozenset(
    {
        112,  # WriteConflict
        11601,  # Interrupted
    }
)
# The server's word that the same command may succeed if sent again.
_RETRY_LABELS = ("TransientTransactionError", "RetryableWriteError")
ENDS_STREAM = frozenset({"invalidate", "drop", "rename", "dropDatabase"})

Triage = Literal["resume", "recover", "fatal"]


def triage(error: BaseException) -> Triage:
    """What a change-stream error calls for: ``resume`` from the token (after a backoff),
    ``recover`` (the token is unusable: sweep, then watch from a fresh cluster time), or
    ``fatal`` (no retry can fix it, e.g. not authorized or not a replica set). An interrupted
    operation, a conflict, or an error the server labels for a retry is resumed too."""
    if isinstance(error, OperationFailure):
        if error.code in _RECOVER_CODES:
            return "recover"
        if error.has_error_label("ResumableChangeStreamError") or error.code in _RESUMABLE_CODES:
            return "resume"
        if error.code in _TRANSIENT_CODES or any(map(error.has_error_label, _RETRY_LABELS)):
            return "resume"
        return "fatal"
    if isinstance(error, ConnectionFailure):  # network errors, NotWritablePrimary, timeouts
        return "resume"
    if isinstance(error, PyMongoError) and error.has_error_label("ResumableChangeStreamError"):
        return "resume"
    return "fatal"


class ChangeBatch(NamedTuple):
    changes: list[dict[str, Any]]
    token: Any
    """The post-batch resume token: where to resume once all of ``changes`` are handled.
    ``None`` when the source cannot tell (then the relay only renews its lease)."""


class ChangeStream(Protocol):
    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        """Up to ``max_size`` changes: once some arrived, only those already delivered
        (returning as soon as they run out, and after about ``max_wait`` at most); after about
        ``max_wait`` seconds when none do."""

    async def aclose(self) -> None: ...


class ChangeSource(Protocol):
    """Opens change streams for a relay; adapts a driver (or, in tests, a script)."""

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> ChangeStream:
        """Watch after the resume token ``resume_after``, or from the operation time
        ``start_at``, or (neither) from now."""

    async def cluster_time(self) -> Any:
        """A time to watch from, taken before the sweep, so nothing falls between the two."""


class WatchSource:
    """``watch()`` of a PyMongo async or Motor collection or database.

    Parameters:
        target: what to watch (a collection, or a database for several collections).
        pipeline: the change stream's pipeline, e.g. a ``$match`` on the operation types.
        full_document: ``"updateLookup"``, ``"whenAvailable"`` (post-images, MongoDB 6+ with
            ``changeStreamPreAndPostImages`` on) or ``None`` for the server's default.
        max_await_ms: how long the server holds a getMore open when nothing happens.
    """

    def __init__(
        self,
        target: Any,
        pipeline: Sequence[dict[str, Any]] = (),
        *,
        full_document: str | None = None,
        max_await_ms: int = 100,
    ) -> None:
        self.target = target
        self.pipeline = list(pipeline)
        self.full_document = full_document
        self.max_await_ms = max_await_ms

    @classmethod
    def for_outbox(
        cls, outbox: Outbox, *, full_document: str = "updateLookup", partition: int | None = None
    ) -> WatchSource:
        """The stream a relay of ``outbox`` needs: inserts into the outbox collection, or (in
        embedded mode) writes to the aggregate collections, with their post-images; with
        ``partition``, only that partition's (by the number the writer stored)."""
        mine: dict[str, Any] = {}
        if partition is not None and outbox.partitions > 1:
            mine = {f"fullDocument.{outbox.partition_field}": partition}
        if outbox.mode == "collection" and not mine:
            types = ["insert", *ENDS_STREAM]
            return cls(outbox.collection, [{"$match": {"operationType": {"$in": types}}}])
        if outbox.mode == "collection":
            match: dict[str, Any] = {
                "$or": [
                    {"operationType": "insert", **mine},
                    {"operationType": {"$in": list(ENDS_STREAM)}},
                ]
            }
            return cls(outbox.collection, [{"$match": match}])
        match = {
            "$or": [
                {
                    "ns.coll": {"$in": list(outbox.collections)},
                    "operationType": {"$in": ["insert", "update", "replace"]},
                    **mine,
                },
                {
                    "ns.coll": {"$in": list(outbox.collections)},
                    "operationType": {"$in": ["drop", "rename"]},
                },
                {"operationType": {"$in": ["invalidate", "dropDatabase"]}},
            ]
        }
        return cls(outbox.db, [{"$match": match}], full_document=full_document)

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> ChangeStream:
        options: dict[str, Any] = {"max_await_time_ms": self.max_await_ms}
        if resume_after is not None:
            options["resume_after"] = resume_after
        elif start_at is not None:
            options["start_at_operation_time"] = start_at
        if self.full_document is not None:
            options["full_document"] = self.full_document
        stream = self.target.watch(self.pipeline, **options)
        # PyMongo's async watch is a coroutine; Motor's returns the stream.
        return _WatchStream(await stream if inspect.isawaitable(stream) else stream)

    async def cluster_time(self) -> Any:
        reply = await database_of(self.target).command("ping")
        return reply.get("operationTime") or reply.get("$clusterTime", {}).get("clusterTime")


def database_of(target: Any) -> Any:
    # Asked on the class: a database's attribute lookup would answer with a collection.
    return target if callable(getattr(type(target), "command", None)) else target.database


class _WatchStream:
    def __init__(self, stream: Any) -> None:
        self.stream = stream
        # Motor reads in a thread that a cancelled await does not stop: a stream read must
        # then not be abandoned (the relay would close the stream beside the running read).
        self.interruptible = not type(stream).__module__.startswith("motor.")

    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        changes: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait
        # Each try_next is one getMore that the server holds open up to max_await_ms when idle.
        # Once a change is in hand the batch takes only what the driver already holds (one
        # getMore's worth: all the server had): another getMore would wait for the next commit,
        # so a lone change would wait out max_wait. But when that first getMore brought more
        # than one change, changes are piling up faster than they are published (a burst): the
        # batch then keeps asking while they keep coming, so a burst goes out in a few large
        # batches, not many small ones, each with its own publish wave. Where the driver's
        # buffer cannot be seen, max_wait closes the batch; it also bounds a steady trickle
        # that never leaves try_next empty.
        piling_up = False
        while len(changes) < max_size and not (changes and loop.time() >= deadline):
            if changes and not piling_up and buffered(self.stream) is False:
                break
            change = await self.stream.try_next()
            if change is None:
                if not self.stream.alive:
                    # The server ended the stream without a word (its invalidate went by
                    # unseen): treat it as the invalidate it stands for.
                    changes.append({"operationType": "invalidate"})
                    break
                if changes or loop.time() >= deadline:
                    break
                continue
            changes.append(change)
            if change["operationType"] in ENDS_STREAM:
                break
            if len(changes) == 1:
                piling_up = buffered(self.stream) is True
        # The driver's resume_token is the last change's when it stopped mid-batch, else the
        # server's post-batch token: it moves on even when nothing matches.
        return ChangeBatch(changes, self.stream.resume_token)

    async def aclose(self) -> None:
        await self.stream.close()


def buffered(stream: Any) -> bool | None:
    """Whether the driver holds changes it has received and not yet handed out, ``None`` when
    it cannot tell. PyMongo keeps them in the cursor's batch; Motor wraps a PyMongo stream
    (created at its first ``try_next``). Neither says so publicly: a driver that moves them
    only makes batches close at ``max_wait`` again."""
    inner = getattr(stream, "delegate", stream)
    has_next = getattr(getattr(inner, "_cursor", None), "_has_next", None)
    if not callable(has_next):
        return None
    answer = has_next()
    return answer if isinstance(answer, bool) else None
