"""Adaptive batching of ChangeStreamRelay on real change streams (PyMongo's watch() against the
test server): a lone change goes out at once, a burst makes batches of many."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from mongo_outbox import Backoff, ChangeStreamRelay, Event, Outbox, RelaySettings
from mongo_outbox.changestream import ChangeBatch, ChangeStream, WatchSource
from mongo_outbox.publishers import MemoryPublisher
from tests.support.changestream_sources import ScriptedSource, inserts
from tests.support.waiting import until

FAST = Backoff(initial=0.01, maximum=0.05)
# Far longer than any publish here takes: a batch that waited for it could not pass the tests.
LONG = 5.0


class NotingSource:
    """WatchSource for the outbox, noting the size of every batch its streams hand out."""

    def __init__(self, outbox: Outbox, max_await_ms: int) -> None:
        self.inner = WatchSource.for_outbox(outbox)
        # An idle getMore held this long: a batch waiting for one more change would wait it out.
        self.inner.max_await_ms = max_await_ms
        self.sizes: list[int] = []

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> ChangeStream:
        return _Noting(await self.inner.open(resume_after=resume_after, start_at=start_at), self)

    async def cluster_time(self) -> Any:
        return await self.inner.cluster_time()


class _Noting:
    def __init__(self, stream: ChangeStream, source: NotingSource) -> None:
        self.stream = stream
        self.source = source

    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        batch = await self.stream.next_batch(max_size, max_wait)
        if batch.changes:
            self.source.sizes.append(len(batch.changes))
        return batch

    async def aclose(self) -> None:
        await self.stream.aclose()


class GatedPublisher(MemoryPublisher):
    """A MemoryPublisher whose first publish waits for ``gate``: the relay stays busy with one
    batch while the test commits more."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def publish(self, event: Event) -> None:
        self.entered.set()
        await self.gate.wait()
        await super().publish(event)


@contextlib.asynccontextmanager
async def following(relay: ChangeStreamRelay, db: Any) -> Any:
    task = asyncio.create_task(relay.run())

    async def watching() -> bool:
        doc = await db.outbox_relays.find_one({"_id": relay.name}) or {}
        return doc.get("fence") is not None and doc.get("token") is not None

    try:
        await until(watching)
        yield
    finally:
        # Cancelled, not stopped: a stopped relay may sit in a getMore held for LONG seconds.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.slow
async def test_a_lone_change_is_published_without_waiting_out_max_wait(db: Any) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    publisher = MemoryPublisher()
    source = NotingSource(outbox, max_await_ms=int(LONG * 1000))
    relay = ChangeStreamRelay(
        outbox,
        publisher,
        name="lone-relay",
        source=source,
        settings=RelaySettings(backoff=FAST),
        max_wait=LONG,
    )
    async with following(relay, db):
        saved = await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
        loop = asyncio.get_running_loop()
        start = loop.time()
        # Before the change, the stream's getMore waits for LONG; after it, a batch that asked
        # for one more change would wait LONG again.
        await publisher.wait_for(1, timeout=LONG / 2)
        elapsed = loop.time() - start
    assert [e.id for e in publisher.events] == [e.id for e in saved.events]
    assert elapsed < LONG / 2
    assert source.sizes == [1]


@pytest.mark.slow
async def test_a_burst_of_commits_is_published_in_batches_of_many(db: Any) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    publisher = GatedPublisher()
    source = NotingSource(outbox, max_await_ms=100)
    relay = ChangeStreamRelay(
        outbox,
        publisher,
        name="burst-relay",
        source=source,
        settings=RelaySettings(backoff=FAST),
        max_wait=LONG,
    )
    count = 30
    ids: list[str] = []
    async with following(relay, db):
        for n in range(count):
            saved = await outbox.save_with_events(
                None, db.orders, {"_id": n}, [Event(type="placed")]
            )
            ids += [e.id for e in saved.events]
            if n == 0:
                # The relay holds the first change's batch in its publish: the rest of the
                # burst piles up on the stream meanwhile.
                await asyncio.wait_for(publisher.entered.wait(), LONG)
        publisher.gate.set()
        await publisher.wait_for(count, timeout=30)
    assert sorted(e.id for e in publisher.events) == sorted(ids)
    assert source.sizes[0] == 1
    assert max(source.sizes) > 1 and len(source.sizes) < count


async def test_checkpoints_follow_quick_batches_at_most_once_per_max_wait(db: Any) -> None:
    """Batches of one change each do not cost a checkpoint write each: the token is saved at
    most once per max_wait while changes flow, and the last one when the relay stops."""
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await db.outbox_relays.insert_one({"_id": "quick-relay", "token": {"_data": "t0"}})
    ids = []
    for n in range(3):
        saved = await outbox.save_with_events(None, db.orders, {"_id": n}, [Event(type="placed")])
        ids += [e.id for e in saved.events]
    entries = await db.outbox.find({"_id": {"$in": ids}}).sort("_id", 1).to_list(None)
    source = ScriptedSource()
    publisher = MemoryPublisher()
    relay = ChangeStreamRelay(
        outbox,
        publisher,
        name="quick-relay",
        source=source,
        settings=RelaySettings(backoff=FAST),
        max_wait=60.0,  # far longer than the test: no save may come from its passing
        sweep_interval=60.0,
    )
    task = asyncio.create_task(relay.run())

    async def token() -> Any:
        return ((await db.outbox_relays.find_one({"_id": "quick-relay"})) or {}).get("token")

    source.play(inserts(entries[:1], "t1"))
    await publisher.wait_for(1)
    await until(lambda: _is(token, {"_data": "t1"}))  # the first batch's token: saved at once
    source.play(inserts(entries[1:2], "t2"), inserts(entries[2:], "t3"))
    await publisher.wait_for(3)
    assert await token() == {"_data": "t1"}  # within max_wait of the last save: not yet
    relay.stop()
    source.play(ChangeBatch([], None))  # wakes the relay from its wait for the next batch
    await asyncio.wait_for(task, LONG * 2)
    assert await token() == {"_data": "t3"}  # saved on the way out
    assert [e.id for e in publisher.events] == ids


async def _is(read: Any, expected: Any) -> bool:
    return bool(await read() == expected)
