"""What a relay parks instead of publishing, and what a requeue brings back: an entry it cannot
read, one that is no document, a pending one without a due time, in both modes; the rest of the
outbox goes on, and a requeue takes ids literally and brings back an aggregate's earlier parked
events with it."""

from __future__ import annotations

from typing import Any

import pytest

from mongo_outbox import (
    Event,
    PollingRelay,
    RelaySettings,
)
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher
from tests.support.outboxes import (
    MODES,
    assert_in_order,
    make_outbox,
    save_one_by_one,
    unsettled,
)


@pytest.mark.parametrize("mode", MODES)
async def test_an_unreadable_entry_is_parked_with_its_error_and_the_rest_goes_on(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    saved = await save_one_by_one(outbox, db, aggregates=3, events=2)
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


async def test_an_entry_that_is_not_a_document_is_parked_and_its_neighbours_go_on(
    db: Any,
) -> None:
    outbox = make_outbox(db, "embedded")
    saved = await save_one_by_one(outbox, db, aggregates=2, events=2)
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


@pytest.mark.parametrize("mode", MODES)
async def test_a_requeued_event_brings_back_the_earlier_parked_ones_of_its_aggregate(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    saved = await save_one_by_one(outbox, db, aggregates=1, events=3)
    refusing = MemoryPublisher(fail=lambda e: RuntimeError("refused"))
    relay = PollingRelay(outbox, refusing, settings=RelaySettings(max_attempts=1))
    await relay.drain()
    assert len(await relay.parked()) == 3
    assert await relay.requeue([saved[2].id]) == 3  # the last one asked for, all three back
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 3
    assert [e.sequence for e in publisher.events] == [1, 2, 3]


@pytest.mark.parametrize("mode", MODES)
async def test_a_requeued_event_starts_with_no_failures_counted(db: Any, mode: str) -> None:
    # Misses too (its destination full or missing): embedded mode kept them, so an event
    # requeued once its queue was bound again was parked after fewer misses than the first time.
    outbox = make_outbox(db, mode)
    [saved] = await save_one_by_one(outbox, db, aggregates=1, events=1)
    refusing = MemoryPublisher(fail=lambda e: RuntimeError("refused"))
    relay = PollingRelay(outbox, refusing, settings=RelaySettings(max_attempts=1))
    await relay.drain()
    counted = {"attempts": 3, "waits": 2, "misses": 2}
    if mode == "collection":
        await db.outbox.update_one({"_id": saved.id}, {"$set": counted})
    else:
        await db.orders.update_one(
            {"_id": 0}, {"$set": {f"_outbox.0.{name}": n for name, n in counted.items()}}
        )
    assert await relay.requeue([saved.id]) == 1
    [entry] = await unsettled(outbox, db)
    assert {name: entry.get(name) or 0 for name in counted} == dict.fromkeys(counted, 0)


async def test_embedded_requeue_takes_event_ids_literally(db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    saved = await save_one_by_one(outbox, db, aggregates=1, events=1)
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
