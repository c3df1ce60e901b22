"""Entries and documents of another producer that the relay can neither hash nor match as they
are (an aggregate id or a document _id that is a document, an array element whose first key
starts with "$", a counter that is no number): each is parked, or published, on its own, and
the rest of the outbox goes on: no round, and no relay, ends for it."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import UpdateOne

from mongo_outbox import PollingRelay
from mongo_outbox.publishers import MemoryPublisher
from tests.support.outboxes import MODES, make_outbox, save_one_by_one


async def test_an_entry_whose_aggregate_id_is_a_document_is_parked_and_the_rest_goes_on(
    db: Any,
) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save_one_by_one(outbox, db, aggregates=2, events=1)
    await db.outbox.insert_one(
        {"_id": "odd", "type": "e", "status": "pending", "aggregate_type": "orders",
         "aggregate_id": {"tenant": 1, "n": 2}, "sequence": 1, "attempts": 0,
         "available_at": saved[0].occurred_at, "occurred_at": saved[0].occurred_at}
    )  # fmt: skip
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == 2  # it raised TypeError: unhashable type: 'dict'
    [parked] = await relay.parked()
    assert parked["_id"] == "odd" and "cannot be read" in parked["last_error"]
    assert await relay.drain() == 0


async def test_an_entry_whose_counter_is_no_number_is_published(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save_one_by_one(outbox, db, aggregates=2, events=1)
    await db.outbox.update_one({"_id": saved[0].id}, {"$set": {"attempts": "many"}})
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 2  # it raised ValueError


@pytest.mark.parametrize(
    "odd",
    [
        # Nothing to send, and an _id that is a document (it raised TypeError in the settle).
        {"_id": {"a": 1}, "_outbox": []},
        # Its one entry is parked: the park's filter named it as an operator (BulkWriteError in
        # every round, and never parked).
        {"_id": 79, "_outbox": [{"$x": 1}]},
    ],
)
async def test_an_odd_embedded_document_does_not_stop_the_rest(
    db: Any, odd: dict[str, Any]
) -> None:
    outbox = make_outbox(db, "embedded")
    saved = await save_one_by_one(outbox, db, aggregates=2, events=1)
    await db.orders.insert_one(odd | {"_outbox_due": saved[0].occurred_at})
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == 2
    assert sorted(e.id for e in publisher.events) == sorted(e.id for e in saved)
    assert len(await relay.parked()) == len(odd["_outbox"])
    stored = await db.orders.find_one({"_id": odd["_id"]})
    assert [e.get("entry") for e in stored["_outbox"]] == odd["_outbox"]  # kept as it was
    assert await relay.drain() == 0


async def test_the_events_of_a_document_whose_id_is_a_document_are_published(db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    saved = await save_one_by_one(outbox, db, aggregates=1, events=1)
    entry = {"id": "odd-1", "type": "e", "aggregate_type": "orders", "aggregate_id": 5,
             "sequence": 1, "occurred_at": saved[0].occurred_at}  # fmt: skip
    await db.orders.insert_one(
        {"_id": {"a": 1}, "_outbox": [entry], "_outbox_due": saved[0].occurred_at}
    )
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == 2
    assert sorted(e.id for e in publisher.events) == sorted([saved[0].id, "odd-1"])
    assert (await db.orders.find_one({"_id": {"a": 1}}))["_outbox"] == []


@pytest.mark.parametrize("mode", MODES)
async def test_a_park_the_server_refuses_costs_the_round_nothing_else(
    db: Any, mode: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = make_outbox(db, mode)
    saved = await save_one_by_one(outbox, db, aggregates=2, events=1)
    if mode == "collection":
        await db.outbox.insert_one(
            {"_id": "odd", "type": "", "status": "pending", "aggregate_type": "orders",
             "aggregate_id": 9, "sequence": 1, "attempts": 0,
             "available_at": saved[0].occurred_at}
        )  # fmt: skip
    else:
        await db.orders.insert_one(
            {"_id": 9, "_outbox": [{"id": "odd"}], "_outbox_due": saved[0].occurred_at}
        )
    relay = PollingRelay(outbox, MemoryPublisher())
    store: Any = relay._rounds.store
    refused = UpdateOne({"_id": {"$nosuchoperator": 1}}, {"$set": {"x": 1}})
    name = "_park" if mode == "collection" else "_park_at"
    monkeypatch.setattr(store, name, lambda *args: refused)
    assert await relay.drain() == 2  # it raised BulkWriteError
    assert "writes for odd entries failed" in caplog.text
