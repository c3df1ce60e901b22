"""ChangeStreamRelay: publishes outbox entries within milliseconds of their commit.

It follows a change stream (collection mode: inserts on the outbox collection; embedded mode:
writes to the aggregate collections that leave entries in their outbox array) and keeps, in a
checkpoint collection keyed by relay name, the resume token up to which every event is confirmed
by the broker and marked published. The outbox documents stay the truth: on first start, and
whenever the token cannot be used (history lost, invalid token, invalidate, drop or rename), the
relay captures a cluster time, sweeps what is pending from the collections themselves, then
watches from that time. One relay per name is active: a lease in the checkpoint document, with a
fencing token that every checkpoint write must still match (see ``_checkpoint``).

Publishing, ordering, retries and parking are the polling relay's: the stream only tells the
relay what to claim (collection mode) or when to look (embedded mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, NamedTuple, Protocol

from pymongo.errors import ConnectionFailure, OperationFailure, PyMongoError

from mongo_outbox._checkpoint import Checkpoint, LeaseLost
from mongo_outbox.backoff import Backoff
from mongo_outbox.errors import ChangeStreamError, describe
from mongo_outbox.events import as_utc, utc_now
from mongo_outbox.outbox import Outbox
from mongo_outbox.publishers.base import Publisher
from mongo_outbox.relay import PollingRelay

log = logging.getLogger(__name__)

HISTORY_LOST = 286
INVALID_RESUME_TOKEN = 260
CHANGE_STREAM_FATAL = 280  # servers before 4.2 answer a resume token they lost with it
_RECOVER_CODES = frozenset({HISTORY_LOST, INVALID_RESUME_TOKEN, CHANGE_STREAM_FATAL})
# Servers before 4.4 send these without the ResumableChangeStreamError label (driver spec).
_RESUMABLE_CODES = frozenset(
    {6, 7, 43, 63, 89, 91, 133, 150, 189, 234, 262, 9001, 10107, 11600, 11602, 13388, 13435, 13436}
)
ENDS_STREAM = frozenset({"invalidate", "drop", "rename", "dropDatabase"})

Triage = Literal["resume", "recover", "fatal"]


def triage(error: BaseException) -> Triage:
    """What a change-stream error calls for: ``resume`` from the token (after a backoff),
    ``recover`` (the token is unusable: sweep, then watch from a fresh cluster time), or
    ``fatal`` (no retry can fix it, e.g. not authorized or not a replica set)."""
    if isinstance(error, OperationFailure):
        if error.code in _RECOVER_CODES:
            return "recover"
        if error.has_error_label("ResumableChangeStreamError") or error.code in _RESUMABLE_CODES:
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
        """Up to ``max_size`` changes, returning early once some arrived and after about
        ``max_wait`` seconds at most when none do."""

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
    def for_outbox(cls, outbox: Outbox, *, full_document: str = "updateLookup") -> WatchSource:
        """The stream a relay of ``outbox`` needs: inserts into the outbox collection, or (in
        embedded mode) writes to the aggregate collections, with their post-images."""
        if outbox.mode == "collection":
            types = ["insert", *ENDS_STREAM]
            return cls(outbox.collection, [{"$match": {"operationType": {"$in": types}}}])
        match = {
            "$or": [
                {
                    "ns.coll": {"$in": list(outbox.collections)},
                    "operationType": {"$in": ["insert", "update", "replace", "drop", "rename"]},
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
        reply = await _database(self.target).command("ping")
        return reply.get("operationTime") or reply.get("$clusterTime", {}).get("clusterTime")


def _database(target: Any) -> Any:
    # Asked on the class: a database's attribute lookup would answer with a collection.
    return target if callable(getattr(type(target), "command", None)) else target.database


class _WatchStream:
    def __init__(self, stream: Any) -> None:
        self.stream = stream

    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        changes: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait
        # Each try_next is one getMore that the server holds open up to max_await_ms when idle.
        # The deadline is checked between changes too: a steady trickle never leaves try_next
        # empty-handed, and must not hold a batch until max_size.
        while len(changes) < max_size and not (changes and loop.time() >= deadline):
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
        # The driver's resume_token is the last change's when it stopped mid-batch, else the
        # server's post-batch token: it moves on even when nothing matches.
        return ChangeBatch(changes, self.stream.resume_token)

    async def aclose(self) -> None:
        await self.stream.close()


State = Literal["starting", "standby", "active", "stopped", "failed"]


@dataclass
class RelayStatus:
    """What an operator needs to see. ``pending`` and the ages are read from the outbox."""

    name: str
    state: State
    active: bool
    last_checkpoint_at: datetime | None
    pending: int
    oldest_pending_age: timedelta | None
    parked: int
    publish_failures: int
    recoveries: int
    last_error: str | None


class ChangeStreamRelay:
    """Publishes an outbox by following its change stream.

    Parameters:
        outbox: the Outbox to relay, in either mode.
        publisher: any Publisher.
        name: the relay's name: its checkpoint, and the lease that one process holds.
        source: where changes come from; default ``WatchSource.for_outbox(outbox)``.
        batch_size, max_wait: a batch closes at ``batch_size`` changes or after ``max_wait`` s.
        lease: seconds the active relay holds its lease without renewing it; a standby takes
            over within ``lease * 1.25`` after it died, ``lease / 4`` after its ``stop()``.
        max_attempts: publish attempts before an entry is parked as dead-lettered (see
            ``parked()`` and ``requeue()``); failures for want of a broker do not count.
        sweep_interval: most seconds between sweeps of the collections (for requeued entries,
            retries that came due, anything the stream missed).
        claim_lease, publish_timeout, max_in_flight, backoff: as for PollingRelay.
        checkpoints: the checkpoint collection, in the outbox's database.
    """

    def __init__(
        self,
        outbox: Outbox,
        publisher: Publisher,
        *,
        name: str,
        source: ChangeSource | None = None,
        batch_size: int = 100,
        max_wait: float = 0.05,
        lease: float = 15.0,
        max_attempts: int = 10,
        sweep_interval: float = 30.0,
        backoff: Backoff | None = None,
        claim_lease: float = 30.0,
        publish_timeout: float = 5.0,
        max_in_flight: int = 256,
        checkpoints: str = "outbox_relays",
    ) -> None:
        if min(max_wait, sweep_interval, lease) <= 0:
            raise ValueError("max_wait, sweep_interval and lease must be positive")
        if not 0 < publish_timeout < claim_lease:
            # Else a sweep could take an entry over while its first publish may still succeed.
            raise ValueError("publish_timeout must be positive and shorter than claim_lease")
        self.outbox = outbox
        self.publisher = publisher
        self.name = name
        self.source: ChangeSource = source or WatchSource.for_outbox(outbox)
        self.batch_size = batch_size
        self.max_wait = max_wait
        self.lease = timedelta(seconds=lease)
        self.max_attempts = max_attempts
        self.sweep_interval = sweep_interval
        self.backoff = backoff or Backoff()
        self.checkpoint = Checkpoint(outbox.db[checkpoints], name, self.lease)
        # The sweep and the publishing path are the polling relay's: one implementation.
        self._poller = PollingRelay(
            outbox,
            publisher,
            batch_size=batch_size,
            backoff=self.backoff,
            max_attempts=self.max_attempts,
            lease=claim_lease,
            publish_timeout=publish_timeout,
            max_in_flight=max_in_flight,
        )
        self.state: State = "starting"
        self.recoveries = 0
        self.last_error: str | None = None
        self._sweep_due = 0.0
        self._saved_at = float("-inf")
        self._stopping = asyncio.Event()

    # -- public API ---------------------------------------------------------------------------

    async def drain(self) -> int:
        """Publish everything pending now (a sweep of the collections); return how many."""
        return await self._poller.drain()

    async def run(self) -> None:
        """Relay until ``stop()`` or cancellation: stand by until this process holds the lease,
        then follow the stream. Resumable errors resume from the checkpoint with backoff; an
        error no retry can fix raises ChangeStreamError. ``stop()`` gives the lease up."""
        self._stopping.clear()
        # Cancellation stands for a crash (the lease runs out); anything else gives it up.
        cancelled = False
        try:
            await self._relay()
        except asyncio.CancelledError:
            cancelled = True
            self.checkpoint.fence = None  # no more writes; the lease in the database runs out
            self._enter("stopped", "cancelled")
            raise
        finally:
            if not cancelled:
                with contextlib.suppress(PyMongoError):
                    await self.checkpoint.release()
        self._enter("stopped", "stop() was called")

    async def _relay(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                if not await self.checkpoint.acquire():
                    self._enter("standby", "another process holds the lease")
                    await self._sleep(self.lease.total_seconds() / 4)
                    continue
                self._enter("active", f"holds the lease, fence {self.checkpoint.fence}")
                await self._follow()
                failures = 0
            except LeaseLost as error:
                self._enter("standby", str(error))
            except ChangeStreamError as error:
                self.last_error = str(error)
                self._enter("failed", str(error))
                raise
            except PyMongoError as error:
                failures += 1
                delay = self.backoff.delay(failures)
                self.last_error = describe(error)
                log.warning(
                    "relay %s: %s; resuming from the checkpoint in %.1fs",
                    self.name,
                    self.last_error,
                    delay,
                )
                await self._sleep(delay)

    def stop(self) -> None:
        self._stopping.set()

    async def status(self) -> RelayStatus:
        doc = await self.checkpoint.load()
        pending, oldest = await self._pending()
        return RelayStatus(
            name=self.name,
            state=self.state,
            active=self.checkpoint.held and doc.get("owner") == self.checkpoint.owner,
            last_checkpoint_at=doc.get("checkpoint_at"),
            pending=pending,
            oldest_pending_age=utc_now() - as_utc(oldest) if oldest else None,
            parked=len(await self.parked()),
            publish_failures=self._poller.stats.failed,
            recoveries=self.recoveries,
            last_error=self.last_error or self._poller.stats.last_error,
        )

    async def parked(self) -> list[dict[str, Any]]:
        """Entries parked as dead-lettered, with their ``last_error``: see
        ``PollingRelay.parked()``."""
        return await self._poller.parked()

    async def requeue(self, event_ids: Sequence[str]) -> int:
        """Make parked entries pending again, with a fresh set of attempts; the active relay's
        next sweep publishes them (this one's at once). Returns how many were requeued."""
        requeued = await self._poller.requeue(event_ids)
        self._sweep_due = 0.0
        return requeued

    # -- following ----------------------------------------------------------------------------

    async def _follow(self) -> None:
        loop = asyncio.get_running_loop()
        # Resuming leaves the sweep to its interval; a recovery's sweep reschedules it.
        self._sweep_due = loop.time() + self.sweep_interval
        self._saved_at = float("-inf")
        stream = await self._open((await self.checkpoint.load()).get("token"))
        try:
            while not self._stopping.is_set():
                try:
                    batch = await stream.next_batch(self.batch_size, self.max_wait)
                except PyMongoError as error:
                    self._fail_unless_recoverable(error)
                    await _close(stream)
                    stream = await self._recover(f"the change stream cannot resume ({error})")
                    continue
                ended = [c for c in batch.changes if c["operationType"] in ENDS_STREAM]
                await self._handle(
                    [c for c in batch.changes if c["operationType"] not in ENDS_STREAM]
                )
                if ended:
                    await _close(stream)
                    stream = await self._recover(f"{ended[0]['operationType']} event")
                    continue
                now = loop.time()
                # A quiet stream's token moves on too: saved every lease/3 with the renewal,
                # so the position stays inside the oplog window.
                quiet_due = now - self._saved_at >= self.lease.total_seconds() / 3
                if batch.token is not None and (batch.changes or quiet_due):
                    await self.checkpoint.save(batch.token)
                    self._saved_at = now
                else:
                    await self.checkpoint.keep()
                if now >= self._sweep_due:
                    await self._sweep()
        finally:
            await _close(stream)

    async def _open(self, token: Any) -> ChangeStream:
        if token is None:
            return await self._recover("no checkpoint yet")
        try:
            return await self.source.open(resume_after=token)
        except PyMongoError as error:
            self._fail_unless_recoverable(error)
            return await self._recover(f"the checkpoint's resume token is unusable ({error})")

    def _fail_unless_recoverable(self, error: PyMongoError) -> None:
        """Return if the token is unusable (recover), re-raise a resumable error for run()'s
        backoff, and turn a fatal one into ChangeStreamError."""
        kind = triage(error)
        if kind == "fatal":
            raise ChangeStreamError(
                f"relay {self.name}: the change stream failed: {error}",
                relay=self.name,
                code=getattr(error, "code", None),
            ) from error
        if kind == "resume":
            raise error

    async def _recover(self, reason: str) -> ChangeStream:
        self.recoveries += 1
        log.warning(
            "relay %s: recovering (%s): sweeping the outbox, then watching from the cluster "
            "time taken before the sweep",
            self.name,
            reason,
        )
        start_at = await self.source.cluster_time()
        if start_at is not None:
            await self._sweep()
        try:
            stream = await self.source.open(start_at=start_at)
        except PyMongoError as error:
            if triage(error) == "fatal":
                self._fail_unless_recoverable(error)
            raise  # run() backs off and starts over from the checkpoint
        if start_at is None:
            # No cluster time to watch from: watch from now first, then sweep, which leaves no
            # gap either (what commits after the open is on the stream, the rest is swept).
            try:
                await self._sweep()
            except BaseException:
                await _close(stream)
                raise
        log.info("relay %s: watching from %s", self.name, start_at or "now")
        return stream

    async def _handle(self, changes: list[dict[str, Any]]) -> None:
        if self.outbox.mode == "embedded":
            # The stream only rings the bell: the documents themselves say what is due.
            field, claim = self.outbox.field, self.outbox.claim_field
            if any(touches_outbox(change, field, claim) for change in changes):
                await self._sweep()
            return
        entries = [
            c["fullDocument"]
            for c in changes
            if c["operationType"] == "insert" and c.get("fullDocument")
        ]
        if not entries:
            return
        published = await self._poller.publish_entries(entries)
        if published < len(entries):
            # Some failed, wait behind an earlier entry, are held by another relay's claim, or
            # were published already (a replay after a restart): the sweep settles which.
            recheck = asyncio.get_running_loop().time() + min(1.0, self.sweep_interval)
            self._sweep_due = min(self._sweep_due, recheck)

    async def _sweep(self) -> int:
        """Publish what is due in the collections, renewing the lease between rounds; then
        schedule the next sweep for when the earliest entry left behind comes due."""
        total = 0
        # Only what was due when the sweep began: later entries are on the stream, and a sweep
        # chasing a busy writer would never hand over to it.
        until = utc_now()
        while True:
            published, more = await self._poller.publish_batch(until)
            total += published
            if not more or self._stopping.is_set():
                break
            await self.checkpoint.keep()
        due = await self._next_due()
        wait = self.sweep_interval
        if due is not None:
            wait = min(max((due - utc_now()).total_seconds(), 1.0), self.sweep_interval)
        self._sweep_due = asyncio.get_running_loop().time() + wait
        return total

    async def _next_due(self) -> datetime | None:
        if self.outbox.mode == "collection":
            doc = await self.outbox.collection.find_one(
                {"status": "pending"}, sort=[("available_at", 1)], projection={"available_at": 1}
            )
            return as_utc(doc["available_at"]) if doc else None
        due = self.outbox.due_field
        times = []
        for name in self.outbox.collections:
            doc = await self.outbox.db[name].find_one(
                {due: {"$exists": True}}, sort=[(due, 1)], projection={due: 1}
            )
            if doc and isinstance(doc.get(due), datetime):
                times.append(as_utc(doc[due]))
        return min(times, default=None)

    async def _pending(self) -> tuple[int, datetime | None]:
        if self.outbox.mode == "collection":
            coll = self.outbox.collection
            oldest = await coll.find_one(
                {"status": "pending"}, sort=[("occurred_at", 1)], projection={"occurred_at": 1}
            )
            count = await coll.count_documents({"status": "pending"})
            return count, oldest["occurred_at"] if oldest else None
        field, total, times = self.outbox.field, 0, []
        for name in self.outbox.collections:
            docs = self.outbox.db[name].find(
                {self.outbox.due_field: {"$exists": True}}, projection={field: 1}
            )
            async for doc in docs:
                entries = [e for e in doc.get(field) or [] if not e.get("parked")]
                total += len(entries)
                times += [e["occurred_at"] for e in entries if "occurred_at" in e]
        return total, min(times, default=None)

    def _enter(self, state: State, reason: str) -> None:
        if state == self.state:
            return
        log.log(
            logging.WARNING if state == "failed" else logging.INFO,
            "relay %s: %s -> %s (%s)",
            self.name,
            self.state,
            state,
            reason,
        )
        self.state = state

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)


def touches_outbox(change: dict[str, Any], field: str, claim_field: str) -> bool:
    """Whether a write to an aggregate may have left entries in its outbox array for the relay
    to look at. A claimed document is left to its claimer: its settle writes again (and rings)
    if entries remain, and a dead claimer's lease is found by the scheduled sweep."""
    document = change.get("fullDocument")
    if document is not None:
        entries = document.get(field) or []
        return document.get(claim_field) is None and any(not e.get("parked") for e in entries)
    if change["operationType"] == "update":
        updated = (change.get("updateDescription") or {}).get("updatedFields") or {}
        return any(key == field or key.startswith(f"{field}.") for key in updated)
    return change["operationType"] in ("insert", "replace")


async def _close(stream: ChangeStream) -> None:
    # A stream that broke may fail to close as well; it is dropped either way.
    with contextlib.suppress(PyMongoError):
        await stream.aclose()
