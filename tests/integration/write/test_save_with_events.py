"""save_with_events against the session's MongoDB: atomicity, versions, sequences, bad input."""

from __future__ import annotations

import uuid
from math import nan
from typing import Any

import pytest
from bson import ObjectId
from pymongo import AsyncMongoClient

from mongo_outbox import (
    ConcurrencyError,
    DuplicateEventError,
    Event,
    InvalidAggregateError,
    InvalidEventError,
    Outbox,
    PollingRelay,
)
from mongo_outbox.publishers import MemoryPublisher
from tests.support.contents import contents
from tests.support.outboxes import MODES, make_outbox
from tests.support.servers import MongoServer


async def stored_events(outbox: Outbox, db: Any) -> list[dict[str, Any]]:
    if outbox.mode == "collection":
        return await db.outbox.find().sort([("aggregate_id", 1), ("sequence", 1)]).to_list(None)
    entries: list[dict[str, Any]] = []
    async for doc in db.orders.find().sort("_id", 1):
        entries.extend(doc.get("_outbox", []))
    return entries


@pytest.mark.parametrize("mode", MODES)
async def test_saves_document_and_events_with_sequences(client: Any, db: Any, mode: str) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    await outbox.ensure_indexes()  # idempotent
    async with client.start_session() as session:
        first = await outbox.save_with_events(
            session,
            db.orders,
            {"_id": "o1", "total": 10},
            [Event(type="order.placed", payload={"total": 10}), Event(type="order.priced")],
        )
        second = await outbox.save_with_events(
            session,
            db.orders,
            {"_id": "o1", "total": 12},
            [Event(type="order.repriced", payload={"total": 12})],
            expected_version=1,
        )
    assert (first.version, second.version) == (1, 2)
    assert [e.sequence for e in first.events + second.events] == [1, 2, 3]
    assert {e.aggregate_type for e in second.events} == {"orders"}
    assert {e.aggregate_id for e in second.events} == {"o1"}
    doc = await db.orders.find_one({"_id": "o1"})
    assert doc["total"] == 12 and doc["_version"] == 2 and doc["_sequence"] == 3
    entries = await stored_events(outbox, db)
    assert [e["type"] for e in entries] == ["order.placed", "order.priced", "order.repriced"]
    assert [e["sequence"] for e in entries] == [1, 2, 3]
    assert entries[0]["payload"] == {"total": 10}


@pytest.mark.parametrize("mode", MODES)
async def test_version_conflict_writes_nothing(client: Any, db: Any, mode: str) -> None:
    outbox = make_outbox(db, mode)
    await outbox.save_with_events(None, db.orders, {"_id": 1, "v": "a"}, [Event(type="a")])
    before = (await db.orders.find_one({"_id": 1}), await stored_events(outbox, db))
    for expected in (0, 2, 5):
        with pytest.raises(ConcurrencyError) as caught:
            await outbox.save_with_events(
                None, db.orders, {"_id": 1, "v": "b"}, [Event(type="b")], expected_version=expected
            )
        assert caught.value.expected_version == expected
    assert (await db.orders.find_one({"_id": 1}), await stored_events(outbox, db)) == before


@pytest.mark.parametrize("mode", MODES)
async def test_owned_fields_come_from_the_store_not_the_caller(db: Any, mode: str) -> None:
    outbox = make_outbox(db, mode)
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    loaded = await db.orders.find_one({"_id": 1})
    loaded["_version"] = 99
    loaded["_sequence"] = 99
    loaded["note"] = "edited"
    saved = await outbox.save_with_events(None, db.orders, loaded, [Event(type="b")])
    assert saved.version == 2 and saved.events[0].sequence == 2
    doc = await db.orders.find_one({"_id": 1})
    assert doc["note"] == "edited" and doc["_sequence"] == 2


async def test_transaction_abort_rolls_back_aggregate_and_events(client: Any, db: Any) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    async with client.start_session() as session:
        with pytest.raises(RuntimeError):
            async with await session.start_transaction():
                await outbox.save_with_events(session, db.orders, {"_id": 1}, [Event(type="a")])
                raise RuntimeError("abort on purpose")
    assert await db.orders.count_documents({}) == 0
    assert await db.outbox.count_documents({}) == 0


async def test_joins_an_open_transaction_without_committing(client: Any, db: Any) -> None:
    outbox = Outbox(db)
    async with client.start_session() as session:
        async with await session.start_transaction():
            await db.audit.insert_one({"_id": "x"}, session=session)
            await outbox.save_with_events(session, db.orders, {"_id": 1}, [Event(type="a")])
            assert session.in_transaction  # not committed by save_with_events
            assert await db.outbox.count_documents({}) == 0  # invisible outside the transaction
    assert await db.outbox.count_documents({}) == 1
    assert await db.audit.count_documents({}) == 1


async def test_duplicate_event_id_in_outbox_writes_nothing(db: Any) -> None:
    outbox = Outbox(db)
    event = Event(type="a")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(None, db.orders, {"_id": 2}, [event])
    assert await db.orders.count_documents({}) == 1


async def test_missing_id_is_generated_like_insert_one(db: Any) -> None:
    doc: dict[str, Any] = {"total": 1}
    saved = await Outbox(db).save_with_events(None, db.orders, doc, [Event(type="a")])
    assert isinstance(doc["_id"], ObjectId) and saved.id == doc["_id"]
    assert saved.events[0].aggregate_id == str(doc["_id"])


@pytest.mark.parametrize("mode", MODES)
async def test_bad_input_raises_before_anything_is_written(
    client: Any, db: Any, mongo: MongoServer, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.save_with_events(None, db.orders, {"_id": 1, "keep": True}, [Event(type="a")])
    before = (await db.orders.find().to_list(None), await stored_events(outbox, db))
    twice = Event(type="twice")
    other: Any = AsyncMongoClient(mongo.uri)
    other_session = other.start_session()
    cases: list[tuple[type[Exception], dict[str, Any]]] = [
        (InvalidEventError, {"events": [twice, twice]}),
        (InvalidEventError, {"events": [Event(type="x", aggregate_id=2)]}),
        (InvalidEventError, {"events": [{"type": "not an Event"}]}),
        (InvalidAggregateError, {"document": {"total": 1}, "expected_version": 3}),
        (InvalidAggregateError, {"document": {"_id": {"compound": 1}}}),
        (InvalidAggregateError, {"expected_version": -1}),
        (InvalidAggregateError, {"session": other_session}),
        (InvalidAggregateError, {"collection": client["elsewhere"].orders}),
        # Events made without validation: stored, each was parked later, and one without a
        # type raised a bare KeyError.
        (InvalidEventError, {"events": [Event.model_construct(payload={})]}),
        (InvalidEventError, {"events": [Event.model_construct(type="x", payload={"a": nan})]}),
        (InvalidEventError, {"events": [Event.model_construct(type="x", id=5)]}),
        # The outbox's own collections and MongoDB's: a document saved into outbox_config made
        # every later Outbox() raise.
        *[
            (InvalidAggregateError, {"collection": db[name], "document": {"_id": "partitions"}})
            for name in ("outbox", "outbox_config", "outbox_event_ids", "system.views")
        ],
    ]
    if mode == "embedded":  # the relay scans only the collections it was given
        cases.append((InvalidAggregateError, {"collection": db.other}))
    for error, overrides in cases:
        args: dict[str, Any] = {
            "session": None,
            "collection": db.orders,
            "document": {"_id": 1, "keep": False},
            "events": [Event(type="b")],
            "expected_version": None,
        } | overrides
        with pytest.raises(error):
            await outbox.save_with_events(
                args["session"],
                args["collection"],
                args["document"],
                args["events"],
                expected_version=args["expected_version"],
            )
    await other_session.end_session()
    await other.close()
    assert (await db.orders.find().to_list(None), await stored_events(outbox, db)) == before
    await make_outbox(db, mode).ensure_indexes()  # the partition record is the outbox's own


@pytest.mark.parametrize("mode", MODES)
async def test_expected_version_zero_refuses_a_document_written_without_the_outbox(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await db.orders.insert_one({"_id": 1, "name": "kept", "lines": [1, 2]})
    before = await contents(db)
    with pytest.raises(ConcurrencyError) as caught:
        await outbox.save_with_events(
            None, db.orders, {"_id": 1}, [Event(type="placed")], expected_version=0
        )
    assert (caught.value.collection, caught.value.aggregate_id) == ("orders", 1)
    assert caught.value.expected_version == 0
    assert await contents(db) == before


@pytest.mark.parametrize("mode", MODES)
async def test_expected_version_zero_creates_the_document_with_its_events(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    saved = await outbox.save_with_events(
        None,
        db.orders,
        {"_id": "o1", "total": 3},
        [Event(type="placed"), Event(type="priced")],
        expected_version=0,
    )
    assert saved.version == 1 and [e.sequence for e in saved.events] == [1, 2]
    empty = await outbox.save_with_events(None, db.orders, {"_id": "o2"}, [], expected_version=0)
    assert empty.version == 1 and empty.events == []
    doc = await db.orders.find_one({"_id": "o1"})
    assert (doc["total"], doc["_version"], doc["_sequence"]) == (3, 1, 2)
    entries = await stored_events(outbox, db)
    assert [(e["type"], e["sequence"]) for e in entries] == [("placed", 1), ("priced", 2)]
    later = await outbox.save_with_events(
        None, db.orders, {"_id": "o1"}, [Event(type="paid")], expected_version=1
    )
    assert later.version == 2 and later.events[0].sequence == 3
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 3
    assert [e.sequence for e in publisher.events] == [1, 2, 3]


@pytest.mark.parametrize("mode", MODES)
async def test_documents_mongodb_cannot_store_are_refused_before_anything_is_written(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.save_with_events(None, db.orders, {"_id": 1, "keep": True}, [Event(type="a")])
    before = await contents(db)
    for document in (
        {"_id": 2**63},
        {"_id": -(2**63) - 1},
        {"_id": 2, "value": object()},
        {"_id": 2, "value": {"deep": [2**64]}},
        {"_id": 2, "text": "lone \ud800 surrogate"},
        {"_id": 2, "$set": {"x": 1}},
        {"_id": 2, "nested": {"$inc": 1}},
        {"_id": 2, "bad\x00key": 1},
        {"_id": uuid.uuid4()},  # this client has no uuidRepresentation to encode it with
    ):
        for expected_version in (None, 0):
            with pytest.raises(InvalidAggregateError) as caught:
                await outbox.save_with_events(
                    None, db.orders, document, [Event(type="b")], expected_version=expected_version
                )
            assert caught.value.collection == "orders"
    assert await contents(db) == before


@pytest.mark.parametrize("mode", MODES)
async def test_a_save_beyond_16_mib_is_refused_before_anything_is_written(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    before = await contents(db)
    nine_mib = "x" * (9 * 1024 * 1024)
    cases: list[tuple[dict[str, Any], list[Event]]] = [
        ({"_id": 1, "blob": nine_mib * 2}, []),
        ({"_id": 1}, [Event(type="big", payload={"blob": nine_mib * 2})]),
    ]
    if mode == "embedded":  # the document holds its pending events: together too large
        cases.append(({"_id": 1, "blob": nine_mib}, [Event(type="big", payload={"b": nine_mib})]))
    for document, events in cases:
        with pytest.raises(InvalidAggregateError, match="too large") as caught:
            await outbox.save_with_events(None, db.orders, document, events)
        assert caught.value.collection == "orders"
    assert await contents(db) == before


def test_event_rejects_non_json_payload() -> None:
    import datetime

    for payload in (
        {"at": datetime.datetime.now()},
        {"n": float("nan")},
        {"big": 2**70},
        {"$set": 1},
        {"nested": {"b": b"bytes"}},
    ):
        with pytest.raises(InvalidEventError):
            Event(type="x", payload=payload)
