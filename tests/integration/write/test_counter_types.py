"""Counters other code stored in another BSON number type (a double, an Int64, a Decimal128:
``$inc`` keeps the type it finds) number events as ints, in both modes and both APIs, and the
relay publishes them in order; a counter that is no whole number is a clear error."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import pytest
from bson import Decimal128, Int64
from pymongo import MongoClient

from mongo_outbox import (
    AggregateNotFoundError,
    ConcurrencyError,
    DuplicateEventError,
    Event,
    InvalidAggregateError,
    InvalidCountersError,
    PollingRelay,
    Saved,
)
from mongo_outbox._codec import counter
from mongo_outbox.publishers import MemoryPublisher
from tests.support.apis import APIS, Writer
from tests.support.contents import contents

# The emulator's $inc turns an Int64 into an int, so there the Int64 case checks the numbering
# only; against a real MongoDB (MONGODB_URI) it also checks that an Int64 comes back an int.
NUMBERS = [(Int64(3), Int64(2)), (3.0, 2.0), (Decimal128("3"), Decimal128("2.0"))]
MODES = ["collection", "embedded"]


@pytest.fixture(params=[(m, a) for m in MODES for a in APIS], ids=lambda p: f"{p[0]}-{p[1]}")
def writer(request: pytest.FixtureRequest, db: Any, sync_client: MongoClient[Any]) -> Writer:
    mode, api = request.param
    options = {"mode": mode, "collections": ["orders"]} if mode == "embedded" else {}
    return Writer(api, db, sync_client, **options)


@pytest.mark.parametrize("numbers", NUMBERS, ids=["int64", "double", "decimal128"])
async def test_counters_in_other_number_types_number_the_events_as_ints(
    writer: Writer, db: Any, numbers: tuple[Any, Any]
) -> None:
    version, sequence = numbers
    await db.orders.insert_one({"_id": 1, "n": 1, "_version": version, "_sequence": sequence})
    saved = [
        await writer.update_with_events(
            None, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [Event(type="a")], expected_version=3
        ),
        await writer.update_with_events(
            None, db.orders, {"_id": 1}, [{"$set": {"n": {"$add": ["$n", 1]}}}], [Event(type="b")]
        ),
        await writer.save_with_events(
            None, db.orders, {"_id": 1, "n": 9}, [Event(type="c")], expected_version=5
        ),
    ]
    assert [(s.version, [e.sequence for e in s.events]) for s in saved] == [
        (4, [3]),
        (5, [4]),
        (6, [5]),
    ]
    assert all(type(s.version) is int and type(s.events[0].sequence) is int for s in saved)
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.relay_outbox, publisher).drain() == 3
    assert [(e.type, e.sequence) for e in publisher.events] == [("a", 3), ("b", 4), ("c", 5)]


async def added_in_a_transaction(writer: Writer, doc_id: Any, events: list[Event]) -> Saved:
    """add_events in a transaction of the writer's own API (it refuses to run outside one)."""
    if writer.api == "async":
        async with writer.db.client.start_session() as session:
            async with await session.start_transaction():
                return await writer.add_events(session, writer.db.orders, doc_id, events)

    def add() -> Saved:
        with writer.sync_db.client.start_session() as session, session.start_transaction():
            saved: Saved = writer.outbox.add_events(session, writer.sync_db.orders, doc_id, events)
            return saved

    return await asyncio.to_thread(add)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("numbers", NUMBERS, ids=["int64", "double", "decimal128"])
async def test_delete_and_add_events_count_from_other_number_types(
    api: str, db: Any, sync_client: MongoClient[Any], numbers: tuple[Any, Any]
) -> None:
    writer = Writer(api, db, sync_client)
    version, sequence = numbers
    for doc_id in (1, 2):
        await db.orders.insert_one({"_id": doc_id, "_version": version, "_sequence": sequence})
    deleted = await writer.delete_with_events(
        None, db.orders, {"_id": 1}, [Event(type="deleted")], expected_version=3
    )
    assert (deleted.version, deleted.events[0].sequence) == (4, 3)
    added = await added_in_a_transaction(writer, 2, [Event(type="noted")])
    assert (added.version, added.events[0].sequence) == (4, 3)
    assert type(added.version) is int and type(deleted.version) is int
    stored = await db.outbox.find().sort("aggregate_id", 1).to_list(None)
    assert [(e["aggregate_id"], e["sequence"]) for e in stored] == [(1, 3), (2, 3)]


async def test_a_counter_that_is_no_whole_number_is_a_clear_error(writer: Writer, db: Any) -> None:
    await db.orders.insert_one({"_id": 1, "_version": 2.5, "_sequence": 1})
    before = await contents(db)
    chosen = Event(id="chosen-1", type="a")
    with pytest.raises(InvalidCountersError, match="whole numbers") as caught:
        await writer.update_with_events(None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [chosen])
    assert (caught.value.collection, caught.value.aggregate_id) == ("orders", 1)
    if writer.relay_outbox.mode == "collection":
        # Found inside the transaction the write ran in, which it aborts.
        assert not caught.value.stored and "not recorded" in str(caught.value)
        assert await contents(db) == before
        return
    # One single-document write, stored before what it returned could be read: the error says
    # so, and the event stays this document's (its reservation and the object's marks kept).
    assert caught.value.stored and "This write is stored, with its events" in str(caught.value)
    assert [e["id"] for e in (await db.orders.find_one({"_id": 1}))["_outbox"]] == ["chosen-1"]
    assert await db.outbox_event_ids.count_documents({"_id": "chosen-1"}) == 1
    await db.orders.insert_one({"_id": 2})
    with pytest.raises(DuplicateEventError, match="one event, one document"):
        await writer.update_with_events(None, db.orders, {"_id": 2}, {"$set": {"y": 1}}, [chosen])
    # _sequence was whole: the relay numbers the entry and publishes it.
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.relay_outbox, publisher).drain() == 1
    assert [(e.id, e.sequence) for e in publisher.events] == [("chosen-1", 2)]


async def test_negative_counters_are_refused_not_numbered_from_zero(
    writer: Writer, db: Any
) -> None:
    # After the write they are in range (0, and 1 for the last event): those before it were not.
    await db.orders.insert_one({"_id": 1, "_version": -1, "_sequence": -2})
    before = await contents(db)
    events = [Event(type="a"), Event(type="b"), Event(type="c")]
    with pytest.raises(InvalidCountersError, match="from 0 to 2"):
        await writer.update_with_events(None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, events)
    if writer.relay_outbox.mode == "collection":
        assert await contents(db) == before


async def test_a_decimal128_version_tells_a_filter_miss_from_a_version_conflict(
    writer: Writer, db: Any
) -> None:
    await db.orders.insert_one({"_id": 1, "status": "open", "_version": Decimal128("3")})
    with pytest.raises(AggregateNotFoundError, match="not the rest of the filter"):
        await writer.update_with_events(
            None,
            db.orders,
            {"_id": 1, "status": "closed"},
            {"$set": {"x": 1}},
            [],
            expected_version=3,
        )
    with pytest.raises(ConcurrencyError):
        await writer.update_with_events(
            None,
            db.orders,
            {"_id": 1, "status": "closed"},
            {"$set": {"x": 1}},
            [],
            expected_version=2,
        )


@pytest.mark.parametrize("api", APIS)
async def test_embedded_entries_of_a_document_whose_sequence_is_no_whole_number_are_parked(
    api: str, db: Any, sync_client: MongoClient[Any]
) -> None:
    # Embedded mode only: collection mode numbers its entries in the write the error aborts.
    writer = Writer(api, db, sync_client, mode="embedded", collections=["orders"])
    await db.orders.insert_one({"_id": 1, "_version": 1, "_sequence": 2.5})
    with pytest.raises(InvalidCountersError):
        await writer.update_with_events(
            None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [Event(type="a")]
        )
    # Pushed unnumbered, and no whole _sequence to number it from: parked, never sent unordered.
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.relay_outbox, publisher).drain() == 0
    assert publisher.events == []
    (entry,) = (await db.orders.find_one({"_id": 1}))["_outbox"]
    assert entry["parked"] and "no sequence" in entry["last_error"]
    assert entry["entry"]["type"] == "a"


@pytest.mark.parametrize("api", APIS)
async def test_a_delete_refuses_counters_that_are_no_numbers(
    api: str, db: Any, sync_client: MongoClient[Any]
) -> None:
    writer = Writer(api, db, sync_client)
    for n, (version, sequence) in enumerate([(False, ""), ([], {}), (1, True), (2**63 - 1, 0)]):
        await db.orders.insert_one({"_id": n, "_version": version, "_sequence": sequence})
        before = await contents(db)
        with pytest.raises(InvalidCountersError, match="not recorded"):
            await writer.delete_with_events(None, db.orders, {"_id": n}, [Event(type="gone")])
        assert await contents(db) == before


@pytest.mark.parametrize(
    ("stored", "whole"),
    [
        (7, 7),
        (Int64(7), 7),
        (7.0, 7),
        (2.0, 2),
        (Decimal128("7"), 7),
        (Decimal128("7.000"), 7),
        (Decimal128("1E+2"), 100),
        (0, 0),
        (Int64(2**63 - 1), 2**63 - 1),
        (2.0**53 - 1, 2**53 - 1),
        (Decimal128("9223372036854775807"), 2**63 - 1),
        (-0.0, 0),
        (Decimal128("-0"), 0),
        (Decimal("12"), 12),  # a codec may decode Decimal128 as a Decimal
        (Decimal("1.5"), None),
        (7.5, None),
        (2.0**53, None),  # a double that $inc no longer moves by 1
        (Decimal128("9223372036854775808"), None),
        (Decimal128("1E+30"), None),
        (2**63, None),
        (-1, None),
        (-1.0, None),
        (float("inf"), None),
        (float("nan"), None),
        (Decimal128("7.5"), None),
        (Decimal128("NaN"), None),
        (Decimal128("Infinity"), None),
        (True, None),
        ("7", None),
        (None, None),
    ],
)
def test_counter_reads_whole_numbers_of_every_bson_number_type(stored: Any, whole: Any) -> None:
    assert counter(stored) == whole
    assert whole is None or type(counter(stored)) is int


async def test_a_counter_mongodb_cannot_add_to_is_refused_by_it(writer: Writer, db: Any) -> None:
    await db.orders.insert_one({"_id": 1, "_version": "three", "_sequence": 2})
    before = await contents(db)
    for write in ("save", "update"):
        with pytest.raises(InvalidAggregateError, match=f"MongoDB refused the {write}"):
            if write == "save":
                await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
            else:
                await writer.update_with_events(
                    None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [Event(type="a")]
                )
    assert await contents(db) == before
