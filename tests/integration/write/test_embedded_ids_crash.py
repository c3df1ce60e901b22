"""Embedded mode's event-id registry under SIGKILL, at every boundary it has: a save killed
between reserving its ids and writing its document, a relay killed between taking ids for their
documents and publishing, and a relay killed between marking ids published and removing their
entries. Nothing is lost, nothing is published under a reused id, and every id stays taken."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from mongo_outbox import DuplicateEventError, Event, Outbox, PollingRelay
from mongo_outbox.publishers import MemoryPublisher, NatsPublisher
from tests.support.contents import contents
from tests.support.outboxes import assert_in_order, unsettled
from tests.support.servers import NATS_URL, MongoServer

ROOT = Path(__file__).resolve().parents[3]


async def killed(*args: str) -> None:
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", *args, cwd=ROOT)
    assert await asyncio.wait_for(process.wait(), 60) == -signal.SIGKILL


async def relay_killed(mongo: MongoServer, db: Any, stream: str, point: str) -> None:
    """Run an embedded relay process to NATS ``stream`` until it dies at ``point``."""
    args = (mongo.uri, db.name, "embedded", "nats", stream, "1000000", point)
    await killed("tests.crash.relay_process", *args)


async def test_a_save_killed_after_reserving_its_ids_is_retried_and_its_ids_stay_taken(
    mongo: MongoServer, db: Any
) -> None:
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    await outbox.ensure_indexes()
    event = Event(id="order-1-a", type="a")  # chosen by the caller: the save reserves it
    await killed("tests.crash.writer_process", mongo.uri, db.name, event.id)
    # The reservation is there, the document is not: no event exists yet.
    assert await db.orders.count_documents({}) == 0
    reservation = await outbox.event_ids.find_one({"_id": event.id})
    assert reservation == {"_id": event.id, "collection": "orders", "aggregate": 1}
    # Another document cannot take the id; the retry of the killed save goes on.
    before = await contents(db)
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(None, db.orders, {"_id": 2}, [event])
    assert await contents(db) == before
    saved = await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    assert [e.sequence for e in saved.events] == [1]
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1
    assert [(e.id, e.aggregate_id, e.sequence) for e in publisher.events] == [(event.id, 1, 1)]


async def test_a_relay_killed_between_marking_ids_published_and_pulling_them_loses_nothing(
    mongo: MongoServer, db: Any, nats_client: Any, nats_stream: str
) -> None:
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    await outbox.ensure_indexes()
    saved: list[Event] = []
    for order in range(8):  # a save, then operator updates: their entries go in unnumbered
        result = await outbox.save_with_events(None, db.orders, {"_id": order}, [Event(type="a")])
        saved += result.events
        for step in range(2):
            result = await outbox.update_with_events(
                None, db.orders, {"_id": order}, {"$inc": {"n": 1}}, [Event(type=f"b{step}")]
            )
            saved += result.events
    await relay_killed(mongo, db, nats_stream, "settle")
    js = nats_client.jetstream()
    assert (await js.stream_info(nats_stream)).state.messages == len(saved)
    # The registry says published, the entries are all still pending in their documents.
    marked = await outbox.event_ids.find({"published": True}).to_list(None)
    assert {m["_id"] for m in marked} == {e.id for e in saved}
    assert len(await unsettled(outbox, db)) == len(saved)
    # A repeated save is refused, in its own document (still pending) as in another.
    again = Event(id=saved[0].id, type="again")
    before = await contents(db)
    for order in (0, 99):
        with pytest.raises(DuplicateEventError):
            await outbox.save_with_events(None, db.orders, {"_id": order}, [again])
    assert await contents(db) == before

    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    relay = PollingRelay(outbox, publisher)
    await asyncio.sleep(2.1)  # the dead relay's lease (2 s)
    assert await relay.drain() == len(saved)
    await publisher.aclose()
    assert await unsettled(outbox, db) == []
    # JetStream dropped the republished messages as duplicates of their Nats-Msg-Id.
    assert (await js.stream_info(nats_stream)).state.messages == len(saved)
    sub = await js.subscribe(f"{nats_stream}.>", ordered_consumer=True)
    received = [Event.from_json((await sub.next_msg(timeout=5)).data) for _ in saved]
    await sub.unsubscribe()
    assert {(e.id, e.sequence) for e in received} == {(e.id, e.sequence) for e in saved}
    assert_in_order(received, saved, once=True)
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(None, db.orders, {"_id": 0}, [again])


@pytest.mark.parametrize("point", ["claim", "retake"])
async def test_a_relay_killed_after_taking_ids_before_publishing_loses_nothing(
    mongo: MongoServer, db: Any, nats_client: Any, nats_stream: str, point: str
) -> None:
    """``claim``: ids the library made, new to the registry, taken with one insert;
    ``retake``: ids the caller chose, reserved by their saves, taken by the check that follows
    the insert's duplicate keys."""
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    await outbox.ensure_indexes()
    saved: list[Event] = []
    for order in range(6):
        if point == "claim":  # no reservation until the relay takes them
            events = [Event(type="a"), Event(type="b")]
        else:
            events = [Event(id=f"order-{order}-{kind}", type=kind) for kind in "ab"]
        result = await outbox.save_with_events(None, db.orders, {"_id": order}, events)
        saved += result.events
    reserved = await outbox.event_ids.find().to_list(None)
    assert [r.get("sequence") for r in reserved] == ([] if point == "claim" else [None] * 12)
    await relay_killed(mongo, db, nats_stream, point)
    js = nats_client.jetstream()
    assert (await js.stream_info(nats_stream)).state.messages == 0
    # Taken for their entries, not published, still pending where they were.
    taken = await outbox.event_ids.find().to_list(None)
    assert {(t["_id"], t["aggregate"], t["sequence"]) for t in taken} == {
        (e.id, e.aggregate_id, e.sequence) for e in saved
    }
    assert not any(t.get("published") for t in taken)
    assert len(await unsettled(outbox, db)) == len(saved)
    # Another document cannot take one of them now; the next relay finds them its own.
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(
            None, db.orders, {"_id": 99}, [Event(id=saved[0].id, type="x")]
        )
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    relay = PollingRelay(outbox, publisher)
    await asyncio.sleep(2.1)  # the dead relay's lease (2 s)
    assert await relay.drain() == len(saved)
    await publisher.aclose()
    assert await relay.parked() == [] and await unsettled(outbox, db) == []
    sub = await js.subscribe(f"{nats_stream}.>", ordered_consumer=True)
    received = [Event.from_json((await sub.next_msg(timeout=5)).data) for _ in saved]
    await sub.unsubscribe()
    assert_in_order(received, saved, once=True)
