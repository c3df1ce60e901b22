"""PollingRelay against the session's MongoDB: counts, order, leases, failures, concurrency, TTL."""

from __future__ import annotations

import asyncio
import random
from datetime import timedelta
from typing import Any

import pytest

from mongo_outbox import (
    Backoff,
    BrokerUnavailableError,
    Event,
    Outbox,
    PollingRelay,
    RelaySettings,
)
from mongo_outbox._relay.store import store_for
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher
from tests.support.outboxes import (
    MODES,
    assert_in_order,
    make_due,
    make_outbox,
    save_history,
)

FAST = Backoff(initial=0.01, maximum=0.05)


async def history(db: Any, mode: str, aggregates: int, saves: int) -> tuple[Outbox, list[Event]]:
    """An outbox of ``mode`` with its indexes, and ``save_history`` in it."""
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    return outbox, await save_history(outbox, db, aggregates, saves)


async def drain_until(relays: list[PollingRelay], count: int, rounds: int = 400) -> int:
    total = 0
    for _ in range(rounds):
        total += sum(await asyncio.gather(*(r.drain() for r in relays)))
        if total >= count:
            return total
        await asyncio.sleep(0.01)
    return total


@pytest.mark.parametrize("mode", MODES)
async def test_drain_publishes_everything_once_and_records_it(db: Any, mode: str) -> None:
    outbox, saved = await history(db, mode, aggregates=5, saves=2)
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher, settings=RelaySettings(batch_size=7))
    assert await relay.drain() == len(saved) == 20
    assert await relay.drain() == 0
    assert_in_order(publisher.events, saved, once=False)
    assert len(publisher.events) == len(saved)
    if mode == "collection":
        entries = await db.outbox.find().to_list(None)
        assert {e["status"] for e in entries} == {"published"}
        for entry in entries:
            assert entry["expire_at"] - entry["published_at"] == outbox.retention
            assert "claim" not in entry
    else:
        for doc in await db.orders.find().to_list(None):
            assert doc["_outbox"] == []
            assert outbox.due_field not in doc and doc.get(outbox.claim_field) is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
async def test_order_holds_through_random_failures(db: Any, mode: str) -> None:
    outbox, saved = await history(db, mode, aggregates=8, saves=3)
    chaos = random.Random(7)
    publisher = MemoryPublisher(
        fail=lambda e: ConnectionError("broker hiccup") if chaos.random() < 0.3 else None
    )
    relay = PollingRelay(outbox, publisher, settings=RelaySettings(batch_size=10, backoff=FAST))
    assert await drain_until([relay], len(saved)) == len(saved)
    assert relay.stats.failed > 0
    assert_in_order(publisher.events, saved, once=False)


class OverlapDetector(MemoryPublisher):
    """A MemoryPublisher that yields mid-publish and records any event published by two
    relays at once, or any aggregate with two events in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: set[str] = set()
        self.aggregates: set[Any] = set()
        self.overlaps: list[str] = []

    async def publish(self, event: Event) -> None:
        if event.id in self.in_flight or event.aggregate_id in self.aggregates:
            self.overlaps.append(event.id)
        self.in_flight.add(event.id)
        self.aggregates.add(event.aggregate_id)
        try:
            await asyncio.sleep(0.001)
            await super().publish(event)
        finally:
            self.in_flight.discard(event.id)
            self.aggregates.discard(event.aggregate_id)


@pytest.mark.parametrize("mode", MODES)
async def test_relays_side_by_side_never_overlap_and_keep_order(db: Any, mode: str) -> None:
    outbox, saved = await history(db, mode, aggregates=6, saves=4)
    publisher = OverlapDetector()
    relays = [
        PollingRelay(outbox, publisher, settings=RelaySettings(batch_size=5), interval=0.01)
        for _ in range(3)
    ]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    await publisher.wait_for(len(saved), timeout=60)
    for relay in relays:
        relay.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert publisher.overlaps == []
    assert len(publisher.events) == len(saved)  # live leases: nothing published twice
    assert_in_order(publisher.events, saved, once=False)
    assert sum(r.stats.published for r in relays) == len(saved)


@pytest.mark.parametrize("mode", MODES)
async def test_failing_head_waits_alone(db: Any, mode: str) -> None:
    outbox, saved = await history(db, mode, aggregates=4, saves=2)
    poisoned = saved[0]  # aggregate 0, sequence 1
    assert (poisoned.aggregate_id, poisoned.sequence) == (0, 1)
    broken = True
    publisher = MemoryPublisher(
        fail=lambda e: RuntimeError("rejected") if broken and e.id == poisoned.id else None
    )
    relay = PollingRelay(
        outbox, publisher, settings=RelaySettings(backoff=Backoff(initial=60, maximum=60))
    )
    assert await relay.drain() == 12  # the other aggregates all went out
    assert {e.aggregate_id for e in publisher.events} == {1, 2, 3}
    if mode == "collection":
        head = await db.outbox.find_one({"_id": poisoned.id})
        assert head["attempts"] == 1 and "RuntimeError: rejected" in head["last_error"]
        waiting = await db.outbox.find({"aggregate_id": 0, "status": "pending"}).to_list(None)
        assert len(waiting) == 4
        assert all(w["available_at"] >= head["available_at"] for w in waiting)
    else:
        doc = await db.orders.find_one({"_id": 0})
        assert len(doc["_outbox"]) == 4
        assert doc["_outbox"][0]["attempts"] == 1
        assert "rejected" in doc["_outbox"][0]["last_error"]
    assert await relay.drain() == 0  # backing off, not hammering
    broken = False
    relay.backoff = FAST
    await make_due(db, outbox)
    assert await relay.drain() == 4
    assert [e.sequence for e in publisher.events if e.aggregate_id == 0] == [1, 2, 3, 4]


@pytest.mark.parametrize("mode", MODES)
async def test_poison_entry_is_parked_listed_and_requeued(db: Any, mode: str) -> None:
    outbox, saved = await history(db, mode, aggregates=2, saves=2)
    poison = saved[0]  # aggregate 0, sequence 1
    broken = True
    publisher = MemoryPublisher(
        fail=lambda e: RuntimeError("rejected") if broken and e.id == poison.id else None
    )
    relay = PollingRelay(outbox, publisher, settings=RelaySettings(backoff=FAST, max_attempts=2))
    for _ in range(4):
        await relay.drain()
        await make_due(db, outbox)
    # Parked after two attempts, it no longer holds back even its own aggregate.
    assert poison.id not in {e.id for e in publisher.events} and len(publisher.events) == 7
    assert [e.sequence for e in publisher.events if e.aggregate_id == 0] == [2, 3, 4]
    [record] = await relay.parked()
    assert (record["_id"], record["status"], record["attempts"]) == (poison.id, "parked", 2)
    assert "RuntimeError: rejected" in record["last_error"]
    assert (record["type"], record["aggregate_id"], record["sequence"]) == (poison.type, 0, 1)
    # Every field of the event, also those stored only when they differ from their default.
    assert {"headers": {}, "correlation_id": None, "causation_id": None}.items() <= record.items()
    if mode == "embedded":
        # It stays in its document, which leaves the relay's index until it is requeued.
        assert record["collection"] == "orders"
        doc = await db.orders.find_one({"_id": 0})
        assert [e["id"] for e in doc["_outbox"]] == [poison.id]
        assert outbox.due_field not in doc
    broken = False
    assert await relay.requeue([poison.id, "not-parked"]) == 1
    assert await relay.drain() == 1
    assert publisher.events[-1].id == poison.id and await relay.parked() == []
    if mode == "embedded":
        doc = await db.orders.find_one({"_id": 0})
        assert doc["_outbox"] == [] and outbox.due_field not in doc


async def test_a_document_left_with_only_parked_entries_is_not_held(db: Any) -> None:
    """Parking an embedded entry is two writes: the park (the document stays due) and then
    taking the document out of the relay's index. A relay that claims it in between finds
    nothing to publish, and must let go at once: else its claim stays until the lease ends
    and the aggregate's next event waits for it."""
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    [poison] = (
        await outbox.save_with_events(None, db.orders, {"_id": 0}, [Event(type="x")])
    ).events
    relay = PollingRelay(
        outbox,
        MemoryPublisher(fail=lambda e: RuntimeError("rejected") if e.id == poison.id else None),
        settings=RelaySettings(max_attempts=1),
    )
    await relay.drain()
    assert [e["_id"] for e in await relay.parked()] == [poison.id]
    # The moment between the two writes: parked, yet still due.
    await db.orders.update_one({"_id": 0}, {"$set": {outbox.due_field: utc_now()}})

    publisher = MemoryPublisher()
    other = PollingRelay(outbox, publisher)
    assert await other.drain() == 0
    doc = await db.orders.find_one({"_id": 0})
    assert outbox.claim_field not in doc and outbox.due_field not in doc
    [later] = (await outbox.save_with_events(None, db.orders, {"_id": 0}, [Event(type="x")])).events
    assert await other.drain() == 1 and publisher.events == [later]
    assert [e["_id"] for e in await other.parked()] == [poison.id]


@pytest.mark.parametrize("mode", MODES)
async def test_a_dead_relays_claims_come_back_after_the_lease(db: Any, mode: str) -> None:
    outbox, saved = await history(db, mode, aggregates=3, saves=1)
    # A relay that claimed and then died: its claim is all that is left of it.
    claim = await store_for(outbox).claim(100, timedelta(seconds=1))
    assert claim.events == len(saved)
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == 0
    await asyncio.sleep(1.1)
    assert await relay.drain() == len(saved)
    assert_in_order(publisher.events, saved, once=False)


async def test_a_claim_held_elsewhere_blocks_later_events_of_its_aggregate(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save_history(outbox, db, aggregates=2, saves=1)
    head = saved[0]
    # Another relay holds the head of aggregate 0 (and only it).
    await db.outbox.update_one(
        {"_id": head.id},
        {"$set": {"claim": "elsewhere", "available_at": head.occurred_at + timedelta(hours=1)}},
    )
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 2  # aggregate 1 only
    assert {e.aggregate_id for e in publisher.events} == {1}
    behind = await db.outbox.find_one({"_id": saved[1].id})
    assert behind["status"] == "pending" and "claim" not in behind
    # It is looked at again within a second (not after the holder's whole lease).
    assert head.occurred_at < behind["available_at"] <= utc_now() + timedelta(seconds=1)


async def test_run_stops_on_stop_and_on_cancel(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher, interval=0.02)
    task = asyncio.create_task(relay.run())
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="late")])
    await publisher.wait_for(1)
    relay.stop()
    await asyncio.wait_for(task, 5)
    task = asyncio.create_task(relay.run())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_run_survives_a_database_outage(mongo: Any) -> None:
    from pymongo import AsyncMongoClient

    # A server that is not there: every round fails, and run() keeps retrying until stopped.
    dead: Any = AsyncMongoClient(
        "mongodb://127.0.0.1:1/?directConnection=true", serverSelectionTimeoutMS=50
    )
    relay = PollingRelay(
        make_outbox(dead.db, "collection"), MemoryPublisher(), settings=RelaySettings(backoff=FAST)
    )
    try:
        task = asyncio.create_task(relay.run())
        await asyncio.sleep(0.5)
        assert not task.done()
        relay.stop()
        # A round waits for the server as long as the client says (serverSelectionTimeoutMS),
        # not the relay's bound on a command's answer (10 s).
        await asyncio.wait_for(task, 5)
    finally:
        await dead.close()  # else its warning fails whichever test the collector runs in


async def test_ttl_prunes_published_entries_only(db: Any) -> None:
    outbox = make_outbox(db, "collection", retention=timedelta(seconds=1))
    await outbox.ensure_indexes()
    info = await db.outbox.index_information()
    assert info["ttl"]["expireAfterSeconds"] == 0 and info["ttl"]["key"] == [("expire_at", 1)]
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a"), Event(type="b")])
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 2
    await outbox.save_with_events(None, db.orders, {"_id": 2}, [Event(type="pending")])
    for _ in range(150):  # a real server's TTL monitor runs every 60 s; the emulator's sooner
        if await db.outbox.count_documents({"status": "published"}) == 0:
            break
        await asyncio.sleep(0.5)
    remaining = await db.outbox.find().to_list(None)
    assert [(e["type"], e["status"]) for e in remaining] == [("pending", "pending")]


async def test_an_event_whose_confirmation_never_comes_while_others_do_is_parked(db: Any) -> None:
    # A timeout counted as an outage of the whole broker, and each round that confirmed others
    # woke it: retried every round for ever, holding its wave for a publish timeout each time.
    outbox = make_outbox(db, "collection")
    await outbox.ensure_indexes()
    tries: list[str] = []

    def fail(event: Event) -> BaseException | None:
        if event.type != "stuck":
            return None
        tries.append(event.id)
        return BrokerUnavailableError("confirmation timed out", event_id=event.id)

    relay = PollingRelay(
        outbox,
        MemoryPublisher(fail=fail),
        settings=RelaySettings(backoff=FAST, max_attempts=2),
    )
    await outbox.save_with_events(None, db.orders, {"_id": "s"}, [Event(type="stuck")])
    for n in range(40):  # others keep coming, and are confirmed
        await outbox.save_with_events(None, db.orders, {"_id": n}, [Event(type="ok")])
        await relay.publish_batch()
    [parked] = await relay.parked()
    assert parked["type"] == "stuck" and "timed out" in parked["last_error"]
    assert len(tries) == 4  # two waits, then two attempts: max_attempts of each


async def test_a_claim_that_leaves_no_time_to_publish_is_told_once_and_loses_nothing(
    db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # A MongoDB slower than claim_lease allows (a loaded server; here each claim is delayed):
    # every round releases its claim unpublished. It used to go round so without a word.
    outbox = make_outbox(db, "collection")
    await outbox.ensure_indexes()
    saved = await outbox.save_with_events(
        None, db.orders, {"_id": 1}, [Event(type="a"), Event(type="b")]
    )
    publisher = MemoryPublisher()
    settings = RelaySettings(claim_lease=0.5, publish_timeout=0.2, backoff=FAST)
    relays = [PollingRelay(outbox, publisher, settings=settings) for _ in range(2)]
    for relay in relays:
        store = relay._rounds.store
        claim = store.claim

        async def slow_claim(*args: Any, claim: Any = claim) -> Any:
            taken = await claim(*args)
            await asyncio.sleep(0.3)  # past the 0.25 s a publish needs to start in
            return taken

        store.claim = slow_claim  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="mongo_outbox.relay"):
        for relay in relays:  # the second takes over from the first
            for _ in range(3):
                assert await relay.publish_batch() == (0, True)
    told = [r for r in caplog.records if "before a publish could start" in r.getMessage()]
    assert len(told) == 2  # once per relay, not once per round
    assert "raise RelaySettings.claim_lease" in told[0].getMessage()
    assert publisher.events == []
    # Nothing lost, nothing charged: a relay with a fitting lease publishes both, in order.
    fitting = PollingRelay(outbox, publisher, settings=RelaySettings(claim_lease=30))
    assert await fitting.drain() == 2
    assert [e.id for e in publisher.events] == [e.id for e in saved.events]
    assert await db.outbox.count_documents({"attempts": {"$gt": 0}}) == 0
