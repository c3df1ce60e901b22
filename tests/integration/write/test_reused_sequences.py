"""A reused ``(aggregate, sequence)`` is refused in collection mode, both APIs: an aggregate
document that lost its counters, or was deleted and created again under its ``_id``, would number
its events from sequences consumers have seen. The outbox's unique index and the look-up of a
write that numbers from 1 refuse such a write and write nothing; entries stored before the index
existed make its build fail with the duplicates named."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import MongoClient

from mongo_outbox import DuplicateSequenceError, Event, Outbox
from tests.support.apis import APIS, Writer


@pytest.fixture(params=APIS)
def writer(request: pytest.FixtureRequest, db: Any, sync_client: MongoClient[Any]) -> Writer:
    return Writer(request.param, db, sync_client)


async def entries(db: Any) -> list[tuple[str, Any, int]]:
    found = await db.outbox.find().sort([("aggregate_id", 1), ("sequence", 1)]).to_list(None)
    return [(e["type"], e["aggregate_id"], e["sequence"]) for e in found]


async def test_a_document_replaced_without_its_counters_is_refused_though_sequence_1_is_pruned(
    writer: Writer, db: Any
) -> None:
    await writer.ensure_indexes()
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a"), Event(type="b")])
    await db.outbox.delete_one({"sequence": 1})  # published more than retention ago: pruned
    await db.orders.replace_one({"_id": 1}, {"total": 5})
    # Sequence 1 is free in the index; the look-up of the document that was there finds 2.
    with pytest.raises(DuplicateSequenceError, match="up to sequence 2"):
        await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="x")])
    assert await entries(db) == [("b", 1, 2)]


async def test_a_document_replaced_without_its_counters_is_refused_and_nothing_is_written(
    writer: Writer, db: Any
) -> None:
    await writer.save_with_events(None, db.orders, {"_id": "o1"}, [Event(type="placed")])
    await writer.save_with_events(None, db.orders, {"_id": "o1"}, [Event(type="paid")])
    # An ODM's own replace (Beanie's replace(), MongoEngine's save of a new object) drops them.
    await db.orders.replace_one({"_id": "o1"}, {"total": 5})
    with pytest.raises(DuplicateSequenceError) as refused:
        await writer.save_with_events(None, db.orders, {"_id": "o1", "total": 6}, [Event(type="x")])
    error = refused.value
    assert error.collection == "outbox"  # the entries' collection
    assert (error.aggregate_type, error.aggregate_id, error.sequence) == ("orders", "o1", 2)
    assert await db.orders.find_one({"_id": "o1"}) == {"_id": "o1", "total": 5}
    with pytest.raises(DuplicateSequenceError):  # an update of operators, too
        await writer.update_with_events(
            None, db.orders, {"_id": "o1"}, {"$inc": {"total": 1}}, [Event(type="x")]
        )
    assert await entries(db) == [("placed", "o1", 1), ("paid", "o1", 2)]
    # The way out the error gives: the counters back, then the numbering goes on.
    await db.orders.update_one({"_id": "o1"}, {"$set": {"_sequence": 2, "_version": 9}})
    saved = await writer.save_with_events(None, db.orders, {"_id": "o1"}, [Event(type="x")])
    assert (saved.version, saved.events[0].sequence) == (10, 3)


async def test_an_aggregate_deleted_and_created_again_under_its_id_is_refused(
    writer: Writer, db: Any
) -> None:
    await writer.ensure_indexes()
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
    await writer.delete_with_events(None, db.orders, {"_id": 1}, [Event(type="deleted")])
    # Created by the write (an insert, an upsert): the unique index refuses its sequence 1.
    for expected in (0, None):
        with pytest.raises(DuplicateSequenceError, match="under sequence 1"):
            await writer.save_with_events(
                None, db.orders, {"_id": 1}, [Event(type="placed")], expected_version=expected
            )
    assert await db.orders.count_documents({}) == 0
    assert await entries(db) == [("placed", 1, 1), ("deleted", 1, 2)]
    # Without events nothing is numbered: the document may be written.
    saved = await writer.save_with_events(None, db.orders, {"_id": 1}, [])
    assert saved.version == 1


async def test_counters_rolled_back_above_zero_meet_the_unique_index(
    writer: Writer, db: Any
) -> None:
    await writer.ensure_indexes()
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a"), Event(type="b")])
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="c")])
    # A stale copy's own save wrote its counters back (Beanie with extra="allow" did).
    await db.orders.update_one({"_id": 1}, {"$set": {"_version": 1, "_sequence": 2}})
    with pytest.raises(DuplicateSequenceError, match="under sequence 3") as refused:
        await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="d")])
    assert refused.value.sequence == 3
    assert (await db.orders.find_one({"_id": 1}))["_sequence"] == 2
    assert await entries(db) == [("a", 1, 1), ("b", 1, 2), ("c", 1, 3)]


async def test_a_refused_write_in_the_callers_transaction_aborts_it(db: Any, client: Any) -> None:
    outbox = Outbox(db)
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
    await db.orders.replace_one({"_id": 1}, {"total": 1})
    async with client.start_session() as session:
        await session.start_transaction()
        await db.stock.insert_one({"_id": "pen"}, session=session)
        with pytest.raises(DuplicateSequenceError):
            await outbox.save_with_events(session, db.orders, {"_id": 1}, [Event(type="x")])
        # Committed, the document write would stand without its event.
        assert not session.in_transaction
    assert await db.stock.count_documents({}) == 0
    assert await db.orders.find_one({"_id": 1}) == {"_id": 1, "total": 1}


async def test_the_unique_index_leaves_out_entries_without_a_numbered_sequence(
    writer: Writer, db: Any
) -> None:
    # Another producer's entries (the relay parks them): no sequence, or not a number.
    odd = {"aggregate_type": "orders", "aggregate_id": 1, "status": "pending"}
    await db.outbox.insert_many(
        [{"_id": "a", **odd}, {"_id": "b", **odd, "sequence": None}, {"_id": "c", **odd}]
    )
    await writer.ensure_indexes()
    info = await db.outbox.index_information()
    assert info["aggregate_sequence"]["unique"] is True
    await db.outbox.insert_one({"_id": "d", **odd, "sequence": "1"})
    saved = await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
    assert saved.events[0].sequence == 1


async def test_duplicates_stored_before_the_index_make_its_build_fail_naming_them(
    writer: Writer, db: Any
) -> None:
    entry = {"aggregate_type": "orders", "status": "published"}
    await db.outbox.insert_many(
        [
            {"_id": "e1", **entry, "aggregate_id": "o1", "sequence": 1},
            {"_id": "e2", **entry, "aggregate_id": "o1", "sequence": 1},
            {"_id": "e3", **entry, "aggregate_id": "o2", "sequence": 1},
        ]
    )
    with pytest.raises(DuplicateSequenceError) as refused:
        await writer.ensure_indexes()
    error = refused.value
    assert (error.aggregate_type, error.aggregate_id, error.sequence) == ("orders", "o1", 1)
    assert "orders 'o1' sequence 1 (entries e1, e2)" in str(error)
    assert "o2" not in str(error)
    info = await db.outbox.index_information()
    assert "aggregate_sequence" not in info
    assert {"relay_due", "aggregate", "ttl", "waiting"} <= set(info)  # the others are built
    await db.outbox.delete_one({"_id": "e2"})
    await writer.ensure_indexes()
    assert "aggregate_sequence" in await db.outbox.index_information()


async def test_embedded_mode_has_nothing_to_refuse_a_document_replaced_without_its_fields(
    db: Any,
) -> None:
    # Its events live in the document: a replace takes the pending ones and the counters with
    # it, and no entry elsewhere remembers them (docs/outbox.md says so).
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
    await db.orders.replace_one({"_id": 1}, {"total": 1})
    saved = await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="x")])
    assert saved.events[0].sequence == 1
