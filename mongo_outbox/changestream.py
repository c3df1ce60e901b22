"""ChangeStreamRelay: publishes outbox entries within milliseconds of their commit.

It follows a change stream of inserts on the outbox collection (collection mode) and keeps, in a
checkpoint collection keyed by relay name, the resume token up to which every event is confirmed
by the broker and marked published. The outbox documents stay the truth: on first start, and
whenever the token cannot be used (history lost, invalid token, invalidate, drop or rename), the
relay captures a cluster time, sweeps what is pending from the collection itself, then watches from
that time. One relay per name is active: a lease in the checkpoint document, with a fencing token
that every checkpoint write must still match.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple, Protocol

from pymongo import ReturnDocument
from pymongo.errors import (
    ConnectionFailure,
    DuplicateKeyError,
    OperationFailure,
    PyMongoError,
)

from mongo_outbox._store import _aware
from mongo_outbox.backoff import Backoff
from mongo_outbox.errors import ChangeStreamError
from mongo_outbox.events import utc_now
from mongo_outbox.outbox import Outbox
from mongo_outbox.publishers.base import Publisher
from mongo_outbox.relay import PollingRelay

log = logging.getLogger(__name__)

HISTORY_LOST = 286
INVALID_RESUME_TOKEN = 260
_RECOVERABLE_CODES = {HISTORY_LOST, INVALID_RESUME_TOKEN}
_ENDS_STREAM = {"invalidate", "drop", "rename", "dropDatabase"}


class ChangeBatch(NamedTuple):
    changes: list[dict[str, Any]]
    token: Any
    """The post-batch resume token: where to resume once all of ``changes`` are handled."""


class ChangeStream(Protocol):
    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch: ...

    async def aclose(self) -> None: ...


class ChangeSource(Protocol):
    """Opens change streams of outbox inserts; adapts a driver (or a test script)."""

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> ChangeStream: ...

    async def cluster_time(self) -> Any:
        """A time to watch from, taken before the sweep, so nothing falls between the two."""


_PIPELINE = [{"$match": {"operationType": {"$in": ["insert", *_ENDS_STREAM]}}}]


class WatchSource:
    """``collection.watch()`` of PyMongo's async API or Motor."""

    def __init__(self, collection: Any) -> None:
        self.collection = collection

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> ChangeStream:
        stream = self.collection.watch(
            _PIPELINE,
            resume_after=resume_after,
            start_at_operation_time=start_at,
            max_await_time_ms=100,
        )
        # PyMongo's watch is a coroutine; Motor's returns the stream.
        return _WatchStream(await stream if inspect.isawaitable(stream) else stream)

    async def cluster_time(self) -> Any:
        reply = await self.collection.database.command("ping")
        return reply.get("operationTime") or reply.get("$clusterTime", {}).get("clusterTime")


class _WatchStream:
    def __init__(self, stream: Any) -> None:
        self.stream = stream

    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        changes: list[dict[str, Any]] = []
        deadline = asyncio.get_running_loop().time() + max_wait
        while len(changes) < max_size and asyncio.get_running_loop().time() < deadline:
            change = await self.stream.try_next()
            if change is None:
                if changes:
                    break
                continue
            changes.append(change)
            if change["operationType"] in _ENDS_STREAM:
                break
        return ChangeBatch(changes, self.stream.resume_token)

    async def aclose(self) -> None:
        await self.stream.close()


@dataclass
class RelayStatus:
    name: str
    active: bool
    last_checkpoint_at: datetime | None
    pending: int
    oldest_pending_age: timedelta | None
    parked: int
    publish_failures: int


class ChangeStreamRelay:
    """Publishes an outbox (collection mode) by following its change stream.

    Parameters:
        outbox: the Outbox to relay (collection mode).
        publisher: any Publisher.
        name: the relay's name: its checkpoint, and the lease that one process holds.
        source: where changes come from; default ``WatchSource(outbox.collection)``.
        batch_size, max_wait: a batch closes at ``batch_size`` changes or after ``max_wait`` s.
        lease: seconds the active relay holds its lease; a standby takes over after it.
        max_attempts: publish attempts before an entry is parked as dead-lettered.
        sweep_interval: seconds between sweeps of the collection (requeued entries, anything the
            stream missed).
        claim_lease, publish_timeout: as for PollingRelay: entries being published are claimed
            for ``claim_lease``; a crashed relay's claims are published again after it.
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
        lease: float = 10.0,
        max_attempts: int = 10,
        sweep_interval: float = 30.0,
        backoff: Backoff | None = None,
        claim_lease: float = 30.0,
        publish_timeout: float = 10.0,
        checkpoints: str = "outbox_relays",
    ) -> None:
        if outbox.mode != "collection":
            raise ValueError("ChangeStreamRelay follows collection-mode outboxes only (for now)")
        self.outbox = outbox
        self.publisher = publisher
        self.name = name
        self.source = source or WatchSource(outbox.collection)
        self.batch_size = batch_size
        self.max_wait = max_wait
        self.lease = timedelta(seconds=lease)
        self.max_attempts = max_attempts
        self.sweep_interval = sweep_interval
        self.backoff = backoff or Backoff()
        self.checkpoints = outbox.db[checkpoints]
        self.owner = uuid.uuid4().hex
        self.fence: int | None = None
        # The sweep and the publishing path are the polling relay's: one implementation.
        self._poller = PollingRelay(
            outbox,
            publisher,
            batch_size=batch_size,
            backoff=self.backoff,
            max_attempts=max_attempts,
            lease=claim_lease,
            publish_timeout=publish_timeout,
        )
        self._sweep_due = 0.0
        self._renew_at = utc_now()
        self._stopping = asyncio.Event()

    # -- public API ---------------------------------------------------------------------------

    async def drain(self) -> int:
        """Publish everything pending now (a sweep of the collection); return how many."""
        return await self._poller.drain()

    async def run(self) -> None:
        """Relay until ``stop()`` or cancellation: standby until this process holds the lease,
        then follow the stream. Resumable errors resume from the checkpoint with backoff."""
        self._stopping.clear()
        failures = 0
        while not self._stopping.is_set():
            if not await self._lead():
                await self._sleep(self.lease.total_seconds() / 3)
                continue
            try:
                await self._follow()
                failures = 0
            except (ConnectionFailure, _Resumable) as error:
                failures += 1
                delay = self.backoff.delay(failures)
                log.warning(
                    "relay %s: stream interrupted (%s), resuming in %.1fs", self.name, error, delay
                )
                await self._sleep(delay)
            except OperationFailure as error:
                if error.has_error_label("ResumableChangeStreamError"):
                    failures += 1
                    await self._sleep(self.backoff.delay(failures))
                    continue
                raise ChangeStreamError(f"relay {self.name}: {error}") from error

    def stop(self) -> None:
        self._stopping.set()

    async def status(self) -> RelayStatus:
        checkpoint = await self.checkpoints.find_one({"_id": self.name}) or {}
        oldest = await self.outbox.collection.find_one(
            {"status": "pending"}, sort=[("occurred_at", 1)], projection={"occurred_at": 1}
        )
        return RelayStatus(
            name=self.name,
            active=checkpoint.get("owner") == self.owner and self.fence is not None,
            last_checkpoint_at=checkpoint.get("checkpoint_at"),
            pending=await self.outbox.collection.count_documents({"status": "pending"}),
            oldest_pending_age=utc_now() - _aware(oldest["occurred_at"]) if oldest else None,
            parked=await self.outbox.collection.count_documents({"status": "parked"}),
            publish_failures=self._poller.stats.failed,
        )

    async def parked(self) -> list[dict[str, Any]]:
        """Entries parked as dead-lettered, with their last error."""
        return list(await self.outbox.collection.find({"status": "parked"}).to_list(None))

    async def requeue(self, event_ids: Sequence[str]) -> int:
        """Make parked entries pending again; the next sweep publishes them."""
        result = await self.outbox.collection.update_many(
            {"_id": {"$in": list(event_ids)}, "status": "parked"},
            {"$set": {"status": "pending", "available_at": utc_now(), "attempts": 0}},
        )
        return int(result.modified_count)

    # -- leadership ---------------------------------------------------------------------------

    async def _lead(self) -> bool:
        """Renew our lease, or take it over once the holder's ran out. A takeover increments
        the fence, so the previous holder's checkpoint writes fail from then on."""
        now = utc_now()
        if self.fence is not None and now < self._renew_at:
            return True
        if self.fence is not None:
            renewed = await self.checkpoints.update_one(
                {"_id": self.name, "owner": self.owner, "fence": self.fence},
                {"$set": {"lease_until": now + self.lease}},
            )
            if renewed.matched_count:
                self._renew_at = now + self.lease / 3
                return True
            self.fence = None
            log.warning("relay %s: lost the lease; standby", self.name)
        try:
            doc = await self.checkpoints.find_one_and_update(
                {"_id": self.name, "lease_until": {"$not": {"$gt": now}}},
                {
                    "$set": {"owner": self.owner, "lease_until": now + self.lease},
                    "$inc": {"fence": 1},
                },
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
        except DuplicateKeyError:  # another process holds a live lease: stay standby
            return False
        self.fence = doc["fence"]
        self._renew_at = now + self.lease / 3
        log.info("relay %s: active (fence %d)", self.name, self.fence)
        return True

    async def _checkpoint(self, token: Any) -> None:
        """Save the resume token and renew the lease, in one write."""
        now = utc_now()
        # Conditional on the fence: a relay that lost its lease must not move the checkpoint.
        result = await self.checkpoints.update_one(
            {"_id": self.name, "fence": self.fence},
            {"$set": {"token": token, "checkpoint_at": now, "lease_until": now + self.lease}},
        )
        if not result.matched_count:
            self.fence = None
            raise _Resumable("lost the lease to another relay")
        self._renew_at = now + self.lease / 3

    # -- following ----------------------------------------------------------------------------

    async def _follow(self) -> None:
        checkpoint = await self.checkpoints.find_one({"_id": self.name}) or {}
        token = checkpoint.get("token")
        try:
            stream = await (
                self.source.open(resume_after=token)
                if token
                else self._recover("no checkpoint yet")
            )
        except OperationFailure as error:
            if error.code not in _RECOVERABLE_CODES:
                raise
            stream = await self._recover(f"resume token unusable ({error.code})")
        loop = asyncio.get_running_loop()
        self._sweep_due = loop.time() + self.sweep_interval
        try:
            while not self._stopping.is_set():
                try:
                    batch = await stream.next_batch(self.batch_size, self.max_wait)
                except OperationFailure as error:
                    if error.code not in _RECOVERABLE_CODES:
                        raise
                    await stream.aclose()
                    stream = await self._recover(f"change stream history lost ({error.code})")
                    continue
                ended = [c for c in batch.changes if c["operationType"] in _ENDS_STREAM]
                inserts = [c for c in batch.changes if c["operationType"] == "insert"]
                await self._publish(inserts)
                if ended:
                    await stream.aclose()
                    stream = await self._recover(f"change stream {ended[0]['operationType']}")
                    continue
                if batch.token is not None:
                    await self._checkpoint(batch.token)
                elif not await self._lead():
                    return
                if loop.time() >= self._sweep_due:
                    # Requeued entries, retries that came due, anything the stream missed.
                    await self._poller.drain()
                    retrying = await self.outbox.collection.count_documents(
                        {"status": "pending", "attempts": {"$gt": 0}}, limit=1
                    )
                    wait = self.backoff.initial if retrying else self.sweep_interval
                    self._sweep_due = loop.time() + wait
        finally:
            await stream.aclose()

    async def _recover(self, reason: str) -> ChangeStream:
        log.warning("relay %s: %s; sweeping the outbox, then watching from now", self.name, reason)
        start_at = await self.source.cluster_time()
        await self._poller.drain()
        return await self.source.open(start_at=start_at)

    async def _publish(self, changes: list[dict[str, Any]]) -> int:
        """Publish the inserted entries through the polling relay's claim, order check and
        settle: a failed entry backs off (and its aggregate's later entries wait behind it)
        until the sweep retries it, or is parked after ``max_attempts``."""
        entries = [c["fullDocument"] for c in changes if c.get("fullDocument")]
        if not entries:
            return 0
        failures = self._poller.stats.failed
        published = await self._poller.publish_entries(entries)
        if self._poller.stats.failed > failures:
            self._sweep_due = 0.0  # retries are the sweep's: run it soon
        return published

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)


class _Resumable(PyMongoError):
    """Resume from the checkpoint (e.g. after losing the lease)."""
