"""A relay's life, either kind: one loop at a time, a stop that comes before the run, the
publishers it refuses, a cancellation from inside a publisher that it survives, a drain that ends
while writers go on, and the status it reports whatever the client's date decoding.

Publishers named FAKE here stand for a broker behaviour no real broker can be made to show on
demand (a client that cancels its own future)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from mongo_outbox import (
    Backoff,
    ChangeStreamRelay,
    ConfigurationError,
    Event,
    PollingRelay,
    RelayGroup,
    RelaySettings,
    UsageError,
)
from mongo_outbox._relay.store import store_for
from mongo_outbox.publishers import MemoryPublisher
from tests.support.changestream_sources import ScriptedSource
from tests.support.outboxes import MODES, assert_in_order, make_outbox, save_one_by_one

FAST = Backoff(initial=0.01, maximum=0.05)
GROUP = RelaySettings(claim_lease=2.0, publish_timeout=0.5)


async def test_one_polling_relay_runs_one_loop_at_a_time(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save_one_by_one(outbox, db, aggregates=3, events=2)
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher, interval=0.01)
    task = asyncio.create_task(relay.run())
    await asyncio.sleep(0)  # run() has started
    for second in (relay.run(), relay.drain(), relay.publish_batch()):
        with pytest.raises(UsageError, match="one loop at a time"):
            await second
    await publisher.wait_for(len(saved))
    relay.stop()
    await asyncio.wait_for(task, 5)
    assert_in_order(publisher.events, saved, once=True)
    assert await relay.drain() == 0  # usable again once the loop ended


async def test_one_change_stream_relay_runs_one_loop_at_a_time(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    relay = ChangeStreamRelay(outbox, MemoryPublisher(), name="r", source=ScriptedSource())
    task = asyncio.create_task(relay.run())
    await asyncio.sleep(0)
    for second in (relay.run(), relay.drain()):
        with pytest.raises(UsageError, match="one loop at a time"):
            await second
    relay.stop()
    await asyncio.wait_for(task, 5)


async def test_one_group_member_runs_one_loop_at_a_time(db: Any) -> None:
    outbox = make_outbox(db, "collection", partitions=2)
    member = RelayGroup(outbox, MemoryPublisher(), member_lease=3.0, settings=GROUP)
    task = asyncio.create_task(member.run())
    await asyncio.sleep(0)
    with pytest.raises(UsageError, match="one loop at a time"):
        await member.run()
    member.stop()
    await asyncio.wait_for(task, 10)
    assert member.state == "stopped"


async def test_a_group_member_that_cannot_start_ends_failed_with_its_error(db: Any) -> None:
    await make_outbox(db, "collection", partitions=4).ensure_indexes()
    outbox = make_outbox(db, "collection", partitions=2)
    member = RelayGroup(outbox, MemoryPublisher(), member_lease=3.0, settings=GROUP)
    with pytest.raises(ConfigurationError, match="records partitions=4"):
        await member.run()
    assert member.state == "failed"
    assert member.last_error is not None and "ConfigurationError" in member.last_error


@pytest.mark.parametrize("mode", MODES)
async def test_rounds_of_one_store_hold_no_state_between_claim_and_settle(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await save_one_by_one(outbox, db, aggregates=4, events=1)
    store = store_for(outbox)
    first = await store.claim(2, timedelta(seconds=30))
    second = await store.claim(2, timedelta(seconds=30))
    assert first.token != second.token and first.events == second.events == 2
    # Settled in the other order, each by its own value: nothing is lost or left claimed.
    await store.settle(second, [e for g in second.groups for e in g], [])
    await store.settle(first, [e for g in first.groups for e in g], [])
    assert (await store.backlog()).pending == 0
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 0


@pytest.mark.parametrize("kind", ["polling", "change stream"])
async def test_stop_called_before_run_started_is_not_lost(db: Any, kind: str) -> None:
    outbox = make_outbox(db, "collection")
    relay: Any = (
        PollingRelay(outbox, MemoryPublisher())
        if kind == "polling"
        else ChangeStreamRelay(outbox, MemoryPublisher(), name="r", source=ScriptedSource())
    )
    relay.stop()
    await asyncio.wait_for(relay.run(), 5)


class PlainPublisher:
    def publish(self, event: Event) -> None:  # not a coroutine: its side effect would repeat
        pass

    async def aclose(self) -> None:
        pass


def test_a_publisher_whose_publish_is_not_a_coroutine_is_refused(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    with pytest.raises(TypeError, match="publish must be an async method"):
        PollingRelay(outbox, PlainPublisher())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="publish must be an async method"):
        ChangeStreamRelay(outbox, PlainPublisher(), name="r")  # type: ignore[arg-type]


class CancelsItself(MemoryPublisher):
    """FAKE client that cancels its own future mid-publish, as aio-pika does when its
    connection is closed under it."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    async def publish(self, event: Event) -> None:
        if self.times:
            self.times -= 1
            raise asyncio.CancelledError
        await super().publish(event)


@pytest.mark.slow
async def test_a_cancellation_from_inside_the_publisher_does_not_stop_the_relay(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save_one_by_one(outbox, db, aggregates=2, events=2)
    publisher = CancelsItself(times=3)
    relay = PollingRelay(outbox, publisher, settings=RelaySettings(backoff=FAST), interval=0.01)
    task = asyncio.create_task(relay.run())
    await publisher.wait_for(len(saved))
    assert not task.done()
    relay.stop()
    await asyncio.wait_for(task, 5)
    assert relay.stats.errors_by_type == {"BrokerUnavailableError": 3}
    assert await relay.parked() == []  # not the events' fault
    assert_in_order(publisher.events, saved, once=True)


async def test_drain_ends_while_a_writer_keeps_saving(db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    await save_one_by_one(outbox, db, aggregates=5, events=1)
    stop = asyncio.Event()

    async def writer() -> None:
        n = 0
        while not stop.is_set():
            await outbox.save_with_events(None, db.orders, {"_id": n % 50}, [Event(type="e")])
            n += 1

    writing = asyncio.create_task(writer())
    try:
        relay = PollingRelay(outbox, MemoryPublisher(), settings=RelaySettings(batch_size=2))
        assert await asyncio.wait_for(relay.drain(), 20) >= 5
    finally:
        stop.set()
        await writing


@pytest.mark.parametrize("mode", MODES)
async def test_a_client_that_decodes_dates_as_milliseconds_gets_the_same_status(
    mongo: Any, db: Any, mode: str
) -> None:
    from bson.codec_options import DatetimeConversion
    from pymongo import AsyncMongoClient

    await save_one_by_one(make_outbox(db, mode), db, aggregates=2, events=1)
    other: Any = AsyncMongoClient(mongo.uri, datetime_conversion=DatetimeConversion.DATETIME_MS)
    try:
        outbox = make_outbox(other[db.name], mode)
        refusing = MemoryPublisher(fail=lambda e: RuntimeError("refused"))
        relay = ChangeStreamRelay(
            outbox, refusing, name="r", source=ScriptedSource(),
            settings=RelaySettings(max_attempts=1),
        )  # fmt: skip
        status = await relay.status()
        assert status.pending == 2 and status.oldest_pending_age is not None
        await relay.drain()
        status = await relay.status()
        assert (status.pending, status.parked) == (0, 2)
        assert all(p["last_error"] for p in await relay.parked())
    finally:
        await other.close()
