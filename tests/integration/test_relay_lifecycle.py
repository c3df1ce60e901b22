"""Relays under misuse and slow or failing brokers: each test is a defect a hostile pass found.

Publishers named FAKE here stand for a broker behaviour no real broker here can be made to show
on demand (a confirm that takes 0.4 s, a client that cancels its own future); everything else
goes through the real NATS or RabbitMQ."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from mongo_outbox import (
    Backoff,
    ChangeStreamRelay,
    Event,
    Outbox,
    PollingRelay,
    RelaySettings,
    UsageError,
)
from mongo_outbox._store import store_for
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher, NatsPublisher
from tests.support.brokers import Broker, KillsTheBroker
from tests.support.changestream_sources import ScriptedSource
from tests.support.outboxes import MODES, assert_in_order, make_outbox
from tests.support.waiting import until

FAST = Backoff(initial=0.01, maximum=0.05)


async def save(outbox: Outbox, db: Any, aggregates: int, events: int) -> list[Event]:
    await outbox.ensure_indexes()
    saved: list[Event] = []
    for order in range(aggregates):
        for _ in range(events):
            result = await outbox.save_with_events(
                None, db.orders, {"_id": order}, [Event(type="e")]
            )
            saved += result.events
    return saved


class SlowBroker(MemoryPublisher):
    """FAKE broker whose every confirm takes ``delay`` seconds: a slow broker on demand."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def publish(self, event: Event) -> None:
        await asyncio.sleep(self.delay)
        await super().publish(event)


# -- misuse ---------------------------------------------------------------------------------


async def test_one_polling_relay_runs_one_loop_at_a_time(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save(outbox, db, aggregates=3, events=2)
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


@pytest.mark.parametrize("mode", MODES)
async def test_rounds_of_one_store_hold_no_state_between_claim_and_settle(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await save(outbox, db, aggregates=4, events=1)
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


async def test_a_cancellation_from_inside_the_publisher_does_not_stop_the_relay(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save(outbox, db, aggregates=2, events=2)
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


# -- undecodable entries ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_an_unreadable_entry_is_parked_with_its_error_and_the_rest_goes_on(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    saved = await save(outbox, db, aggregates=3, events=2)
    bad = {"type": "", "payload": ["not", "an", "object"], "sequence": 9}
    if mode == "collection":
        await db.outbox.insert_one(
            bad
            | {
                "_id": "bad",
                "status": "pending",
                "aggregate_type": "orders",
                "aggregate_id": 1,
                "available_at": saved[0].occurred_at,
                "attempts": 0,
            }
        )
    else:
        await db.orders.update_one(
            {"_id": 1}, {"$push": {"_outbox": {"$each": [bad | {"id": "bad"}], "$position": 0}}}
        )
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == len(saved)
    assert_in_order(publisher.events, saved, once=True)
    [parked] = await relay.parked()
    assert parked["_id"] == "bad" and "cannot be read" in parked["last_error"]
    assert await relay.drain() == 0  # and it stays parked: no hot loop on it


# -- slow brokers and leases ------------------------------------------------------------------


async def test_a_slow_broker_never_lets_two_polling_relays_publish_an_event_twice(
    db: Any,
) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save(outbox, db, aggregates=1, events=12)
    broker = SlowBroker(0.4)  # 12 confirms in a row take 4.8 s; a claim holds 2 s
    settings = RelaySettings(claim_lease=2.0, publish_timeout=1.0, backoff=FAST)
    relays = [PollingRelay(outbox, broker, settings=settings, interval=0.05) for _ in range(2)]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    await broker.wait_for(len(saved), timeout=30)
    await asyncio.sleep(settings.lease.total_seconds())  # a late duplicate would arrive by now
    for relay in relays:
        relay.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert_in_order(broker.events, saved, once=True)


async def test_a_slow_round_keeps_the_leader_lease_and_one_relay_active(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save(outbox, db, aggregates=2, events=15)
    broker = SlowBroker(0.3)  # the first sweep takes 4.5 s, the leader lease is 1 s
    settings = RelaySettings(claim_lease=2.0, publish_timeout=1.0, backoff=FAST)
    relays = [
        ChangeStreamRelay(
            outbox,
            broker,
            name="r",
            source=ScriptedSource(),
            settings=settings,
            leader_lease=1.0,
            sweep_interval=60,
        )
        for _ in range(2)
    ]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    both = samples = 0
    while len(broker.events) < len(saved):
        samples += 1
        both += all(r.state == "active" for r in relays)
        for relay in relays:
            assert (await relay.status()).active == (relay.state == "active")
        await asyncio.sleep(0.05)
        assert samples < 400, "not published in 20 s"
    for relay in relays:
        relay.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert both == 0, f"both active in {both} of {samples} samples"
    assert_in_order(broker.events, saved, once=True)


async def test_a_deleted_checkpoint_never_leaves_two_relays_active_for_good(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    relays = [
        ChangeStreamRelay(
            outbox, MemoryPublisher(), name="r", source=ScriptedSource(), leader_lease=0.6
        )
        for _ in range(2)
    ]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    await until(lambda: any(r.state == "active" for r in relays))
    for _ in range(2):  # deleted, then deleted again once someone recreated it
        await db.outbox_relays.delete_many({})
        await until(lambda: db.outbox_relays.count_documents({}))
        await asyncio.sleep(1.0)  # the renewal interval and a standby's poll have passed
        for _ in range(20):
            assert sum(r.state == "active" for r in relays) == 1
            for relay in relays:
                assert (await relay.status()).active == (relay.state == "active")
            await asyncio.sleep(0.05)
    doc = await db.outbox_relays.find_one({"_id": "r"})
    [leader] = [r for r in relays if r.state == "active"]
    assert doc["owner"] == leader.checkpoint.owner
    for relay in relays:
        relay.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)


# -- requeue ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_a_requeued_event_brings_back_the_earlier_parked_ones_of_its_aggregate(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    saved = await save(outbox, db, aggregates=1, events=3)
    refusing = MemoryPublisher(fail=lambda e: RuntimeError("refused"))
    relay = PollingRelay(outbox, refusing, settings=RelaySettings(max_attempts=1))
    await relay.drain()
    assert len(await relay.parked()) == 3
    assert await relay.requeue([saved[2].id]) == 3  # the last one asked for, all three back
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 3
    assert [e.sequence for e in publisher.events] == [1, 2, 3]


async def test_embedded_requeue_takes_event_ids_literally(db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    saved = await save(outbox, db, aggregates=1, events=1)
    refusing = MemoryPublisher(fail=lambda e: RuntimeError("refused"))
    relay = PollingRelay(outbox, refusing, settings=RelaySettings(max_attempts=1))
    await relay.drain()
    assert await relay.requeue(["$x"]) == 0
    assert await relay.requeue(["$$e.id", "$_outbox.id"]) == 0
    [parked] = await relay.parked()
    assert parked["_id"] == saved[0].id


async def test_an_unreadable_embedded_entry_comes_back_with_its_number_when_requeued(
    db: Any,
) -> None:
    # Pushed unnumbered (as an operator update pushes), it is parked wrapped, with the number its
    # position gave it; the entry after it is published and removed, so that position no longer
    # tells its number. Requeued once fixed by hand, it goes out under its own number.
    outbox = make_outbox(db, "embedded")
    await db.orders.insert_one({"_id": 0, "_version": 1, "_sequence": 0})
    base = {"aggregate_type": "orders", "aggregate_id": 0, "occurred_at": utc_now()}
    unreadable, later = Event(type="fixed").id, Event(type="later")
    await db.orders.update_one(
        {"_id": 0},
        {
            "$push": {
                "_outbox": {
                    "$each": [
                        base | {"id": unreadable, "type": ""},
                        base | {"id": later.id, "type": "later"},
                    ]
                }
            },
            "$inc": {"_sequence": 2},
            "$set": {"_outbox_due": utc_now()},
        },
    )
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == 1
    assert [(e.id, e.sequence) for e in publisher.events] == [(later.id, 2)]
    [wrapped] = (await db.orders.find_one({"_id": 0}))["_outbox"]
    assert wrapped["parked"] and wrapped["entry"]["sequence"] == 1
    await db.orders.update_one({"_id": 0}, {"$set": {"_outbox.0.entry.type": "fixed"}})
    assert await relay.requeue([unreadable]) == 1
    assert await relay.drain() == 1
    assert [(e.id, e.sequence) for e in publisher.events][1:] == [(unreadable, 1)]
    assert await relay.parked() == []


async def test_an_unreadable_embedded_entry_without_a_number_stays_parked(db: Any) -> None:
    # Its document's _sequence was no whole number, so nothing told its number: a requeue would
    # guess it from its position, which entries removed after it may have shifted.
    outbox = make_outbox(db, "embedded")
    entry = {"id": "broken", "type": "x", "aggregate_type": "orders", "aggregate_id": 0}
    await db.orders.insert_one(
        {
            "_id": 0,
            "_sequence": 1.5,
            "_outbox": [entry | {"occurred_at": utc_now()}],
            "_outbox_due": utc_now(),
        }
    )
    relay = PollingRelay(outbox, MemoryPublisher())
    assert await relay.drain() == 0
    [parked] = await relay.parked()
    assert parked["_id"] == "broken" and "no sequence" in parked["last_error"]
    assert await relay.requeue(["broken"]) == 0
    assert [e["_id"] for e in await relay.parked()] == ["broken"]


# -- outages ----------------------------------------------------------------------------------


async def test_a_backlog_drains_at_full_speed_once_the_broker_is_back(
    db: Any, broker: Broker, unique: str
) -> None:
    import nats

    nc = await nats.connect(broker.url)
    await nc.jetstream().add_stream(name=unique, subjects=[f"{unique}.>"])
    await nc.close()
    outbox = make_outbox(db, "collection")
    await save(outbox, db, aggregates=20, events=10)
    inner = await NatsPublisher.connect(broker.url, subject=f"{unique}.{{type}}", timeout=0.5)
    publisher = KillsTheBroker(inner, broker, after=10, down_for=5.0)
    relay = PollingRelay(
        outbox, publisher, settings=RelaySettings(claim_lease=2, publish_timeout=1)
    )
    task = asyncio.create_task(relay.run())
    try:
        await until(lambda: publisher.back_at is not None, timeout=30)
        while await db.outbox.count_documents({"status": "pending"}):
            assert publisher.back_at is not None
            elapsed = asyncio.get_running_loop().time() - publisher.back_at
            assert elapsed < 10, "the backlog is still draining 10 s after the broker came back"
            await asyncio.sleep(0.1)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
        await publisher.aclose()
    assert relay.stats.failed > 0 and await relay.parked() == []


async def test_an_unroutable_event_becomes_its_own_failure_while_others_are_confirmed(
    db: Any, nats_stream: str
) -> None:
    # Embedded mode: saves beside a running relay need no transaction (see docs/testing.md).
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    [lost] = (
        await outbox.save_with_events(None, db.orders, {"_id": "x"}, [Event(type="lost")])
    ).events
    # Only ok.* subjects have a stream: the lost event has nowhere to go, the others do.
    subject = lambda e: f"{nats_stream}.ok" if e.type == "ok" else f"nowhere-{nats_stream}"  # noqa: E731
    publisher = await NatsPublisher.connect(subject=subject, timeout=0.5)
    relay = PollingRelay(
        outbox, publisher, settings=RelaySettings(max_attempts=3, backoff=FAST), interval=0.02
    )
    task = asyncio.create_task(relay.run())
    try:
        for order in range(200):  # a steady flow of routable events meanwhile
            await outbox.save_with_events(None, db.orders, {"_id": order}, [Event(type="ok")])
            if await relay.parked():
                break
            await asyncio.sleep(0.05)
        [parked] = await relay.parked()
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
        await publisher.aclose()
    assert parked["_id"] == lost.id and parked["attempts"] == 3
    assert isinstance(parked["last_error"], str) and parked["last_error"]
    # Its retries were spaced by its own growing delay, not three a second for ever.
    assert relay.stats.errors_by_type.get("BrokerUnavailableError", 0) < 40


# -- found by a hostile review of the rewritten core ----------------------------------------


async def test_a_wave_wider_than_the_in_flight_window_never_outlives_its_claim(
    db: Any,
) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save(outbox, db, aggregates=4, events=1)
    broker = SlowBroker(0.9)  # one at a time: the wave of four would take 3.6 s of a 2 s claim
    settings = RelaySettings(
        batch_size=4, max_in_flight=1, claim_lease=2.0, publish_timeout=1.0, backoff=FAST
    )
    relays = [PollingRelay(outbox, broker, settings=settings, interval=0.05) for _ in range(2)]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    await broker.wait_for(len(saved), timeout=30)
    await asyncio.sleep(2.0)  # a late duplicate would arrive by now
    for relay in relays:
        relay.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert_in_order(broker.events, saved, once=True)


async def test_an_entry_that_is_not_a_document_is_parked_and_its_neighbours_go_on(
    db: Any,
) -> None:
    outbox = make_outbox(db, "embedded")
    saved = await save(outbox, db, aggregates=2, events=2)
    await db.orders.update_one({"_id": 0}, {"$push": {"_outbox": {"$each": [None, 7]}}})
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == len(saved)
    assert_in_order(publisher.events, saved, once=True)
    parked = await relay.parked()
    assert sorted(str(p["entry"]) for p in parked) == ["7", "None"]
    assert all("not a document" in p["last_error"] for p in parked)
    assert (await relay.requeue([saved[0].id])) == 0  # published, not parked; nothing raised
    assert await relay.drain() == 0


async def test_a_pending_entry_without_a_due_time_is_parked_instead_of_blocking(
    db: Any,
) -> None:
    outbox = make_outbox(db, "collection")
    await outbox.ensure_indexes()
    await db.outbox.insert_one(
        {"_id": "odd", "type": "e", "status": "pending", "aggregate_type": "orders",
         "aggregate_id": 0, "sequence": 1}
    )  # fmt: skip
    await db.orders.insert_one({"_id": 0, "_version": 1, "_sequence": 1})
    [later] = (await outbox.save_with_events(None, db.orders, {"_id": 0}, [Event(type="e")])).events
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    await relay.drain()
    assert await relay.drain() + len(publisher.events) == 1
    assert [e.id for e in publisher.events] == [later.id]
    [parked] = await relay.parked()
    assert parked["_id"] == "odd" and "available_at" in parked["last_error"]


async def test_a_full_destination_waits_its_own_delay_while_others_flow(db: Any) -> None:
    from mongo_outbox import BrokerFullError

    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    [full] = (
        await outbox.save_with_events(None, db.orders, {"_id": "x"}, [Event(type="full")])
    ).events

    def fail(event: Event) -> BaseException | None:
        if event.type == "full":
            return BrokerFullError("queue full (reject-publish)", event_id=event.id)
        return None

    publisher = MemoryPublisher(fail=fail)
    # A delay drawn from [0, 300 s), then [0, 600 s): a second try within the few seconds of
    # this test is a 1-in-30 chance even on a slow machine, a third one about 1 in 2,000.
    slow_retry = RelaySettings(backoff=Backoff(initial=300, maximum=3000))
    relay = PollingRelay(outbox, publisher, settings=slow_retry, interval=0.02)
    task = asyncio.create_task(relay.run())
    for order in range(30):  # three seconds of other traffic, confirmed every round
        await outbox.save_with_events(None, db.orders, {"_id": order}, [Event(type="ok")])
        await asyncio.sleep(0.1)
    relay.stop()
    await asyncio.wait_for(task, 10)
    # Tried once, or twice if the random delay was short: not woken each second with the rest
    # (which would try it 30 times).
    assert relay.stats.errors_by_type["BrokerFullError"] <= 2
    assert await relay.parked() == [] and len(publisher.events) == 30
    assert full.id not in {e.id for e in publisher.events}


async def test_drain_ends_while_a_writer_keeps_saving(db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    await save(outbox, db, aggregates=5, events=1)
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

    await save(make_outbox(db, mode), db, aggregates=2, events=1)
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
