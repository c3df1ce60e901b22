"""delete_with_events and add_events, both APIs: the aggregate's counters number the events
gap-free, the write and its events commit together, and misuse is refused before writing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pymongo import MongoClient

from mongo_outbox import (
    AggregateNotFoundError,
    ConcurrencyError,
    Event,
    InvalidAggregateError,
    PollingRelay,
    UsageError,
)
from mongo_outbox.publishers import MemoryPublisher
from mongo_outbox.sync import Outbox as SyncOutbox
from tests.support.apis import APIS, Writer
from tests.support.contents import contents


@pytest.fixture(params=APIS)
def writer(request: pytest.FixtureRequest, db: Any, sync_client: MongoClient[Any]) -> Writer:
    return Writer(request.param, db, sync_client)


async def entries(db: Any) -> list[tuple[str, Any, int]]:
    found = await db.outbox.find().sort("sequence", 1).to_list(None)
    return [(e["type"], e["aggregate_id"], e["sequence"]) for e in found]


async def test_a_delete_removes_the_aggregate_and_records_its_events(
    writer: Writer, db: Any
) -> None:
    await writer.save_with_events(None, db.orders, {"_id": "o1"}, [Event(type="placed")])
    await writer.update_with_events(
        None, db.orders, {"_id": "o1"}, {"$set": {"paid": True}}, [Event(type="paid")]
    )
    deleted = await writer.delete_with_events(
        None, db.orders, {"_id": "o1", "paid": True}, [Event(type="deleted")], expected_version=2
    )
    assert deleted.id == "o1" and deleted.version == 3
    assert [(e.sequence, e.aggregate_id) for e in deleted.events] == [(3, "o1")]
    assert await db.orders.count_documents({}) == 0
    assert await entries(db) == [("placed", "o1", 1), ("paid", "o1", 2), ("deleted", "o1", 3)]
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.relay_outbox, publisher).drain() == 3
    assert publisher.events[-1] == deleted.events[0]


async def test_a_delete_of_a_document_written_without_the_outbox_numbers_from_one(
    writer: Writer, db: Any
) -> None:
    await db.orders.insert_one({"_id": "legacy", "note": "no counters"})
    deleted = await writer.delete_with_events(
        None, db.orders, {"_id": "legacy"}, [Event(type="deleted"), Event(type="archived")]
    )
    assert deleted.version == 1 and [e.sequence for e in deleted.events] == [1, 2]
    assert await entries(db) == [("deleted", "legacy", 1), ("archived", "legacy", 2)]


async def test_a_refused_delete_writes_nothing(writer: Writer, db: Any) -> None:
    await writer.save_with_events(None, db.orders, {"_id": 1, "open": True}, [Event(type="a")])
    before = await contents(db)
    with pytest.raises(ConcurrencyError):
        await writer.delete_with_events(
            None, db.orders, {"_id": 1}, [Event(type="deleted")], expected_version=2
        )
    with pytest.raises(AggregateNotFoundError, match="no document has that _id"):
        await writer.delete_with_events(None, db.orders, {"_id": 2}, [Event(type="deleted")])
    with pytest.raises(AggregateNotFoundError, match="not the rest of the filter"):
        await writer.delete_with_events(
            None, db.orders, {"_id": 1, "open": False}, [Event(type="deleted")]
        )
    for query, options in (
        ({"open": True}, {}),
        ({"_id": {"$in": [1]}}, {}),
        ({"_id": 1}, {"expected_version": 0}),
        ({"_id": 1}, {"expected_version": "1"}),
    ):
        with pytest.raises(InvalidAggregateError):
            await writer.delete_with_events(
                None, db.orders, query, [Event(type="deleted")], **options
            )
    assert await contents(db) == before


@pytest.mark.parametrize("api", APIS)
async def test_embedded_mode_refuses_delete_and_add_events_and_writes_nothing(
    db: Any, sync_client: MongoClient[Any], api: str
) -> None:
    writer = Writer(api, db, sync_client, mode="embedded", collections=["orders"])
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    before = await contents(db)
    with pytest.raises(UsageError, match="update_with_events"):
        await writer.delete_with_events(None, db.orders, {"_id": 1}, [Event(type="deleted")])
    with pytest.raises(UsageError, match="update_with_events"):
        await writer.add_events(None, db.orders, 1, [Event(type="b")])
    assert await contents(db) == before


async def test_events_beside_the_callers_own_writes_commit_with_them(
    client: Any, db: Any, sync_client: MongoClient[Any]
) -> None:
    writer = Writer("async", db, sync_client)
    await writer.save_with_events(None, db.orders, {"_id": 1, "lines": []}, [Event(type="a")])
    async with client.start_session() as session:
        async with await session.start_transaction():
            await db.orders.update_one({"_id": 1}, {"$push": {"lines": "book"}}, session=session)
            await db.stock.update_one(
                {"_id": "book"}, {"$inc": {"reserved": 1}}, upsert=True, session=session
            )
            added = await writer.add_events(
                session, db.orders, 1, [Event(type="line_added"), Event(type="reserved")]
            )
            assert await db.outbox.count_documents({}) == 1  # not visible before the commit
        with pytest.raises(RuntimeError):
            async with await session.start_transaction():
                await writer.add_events(session, db.orders, 1, [Event(type="aborted")])
                raise RuntimeError("abort on purpose")
    assert added.version == 2 and [e.sequence for e in added.events] == [2, 3]
    later = await writer.update_with_events(
        None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [Event(type="later")]
    )
    assert later.version == 3 and later.events[0].sequence == 4
    assert await entries(db) == [
        ("a", 1, 1),
        ("line_added", 1, 2),
        ("reserved", 1, 3),
        ("later", 1, 4),
    ]
    stored = await db.orders.find_one({"_id": 1})
    assert (stored["lines"], stored["_sequence"]) == (["book"], 4)


def test_sync_events_beside_the_callers_own_writes_commit_with_them(
    sync_client: MongoClient[Any],
) -> None:
    db = sync_client["t_sync_add_events"]
    sync_client.drop_database(db.name)
    try:
        outbox = SyncOutbox(db)
        outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
        with sync_client.start_session() as session, session.start_transaction():
            db.orders.update_one({"_id": 1}, {"$set": {"paid": True}}, session=session)
            added = outbox.add_events(session, db.orders, 1, [Event(type="paid")])
        assert added.version == 2 and added.events[0].sequence == 2
        assert db.outbox.count_documents({"aggregate_id": 1}) == 2
    finally:
        sync_client.drop_database(db.name)


async def test_add_events_outside_a_transaction_or_without_an_aggregate_writes_nothing(
    writer: Writer, db: Any, client: Any, sync_client: MongoClient[Any]
) -> None:
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    before = await contents(db)
    with pytest.raises(UsageError, match="transaction"):
        await writer.add_events(None, db.orders, 1, [Event(type="b")])
    if writer.api == "async":
        async with client.start_session() as session:
            with pytest.raises(UsageError, match="transaction"):
                await writer.add_events(session, db.orders, 1, [Event(type="b")])
            with pytest.raises(AggregateNotFoundError):
                async with await session.start_transaction():
                    await writer.add_events(session, db.orders, 2, [Event(type="b")])
    else:

        def sync_misuse() -> None:
            with sync_client.start_session() as session:
                with pytest.raises(UsageError, match="transaction"):
                    writer.outbox.add_events(session, writer.sync_db.orders, 1, [Event(type="b")])
                with pytest.raises(AggregateNotFoundError), session.start_transaction():
                    writer.outbox.add_events(session, writer.sync_db.orders, 2, [Event(type="b")])

        await asyncio.to_thread(sync_misuse)
    assert await contents(db) == before


async def test_add_events_to_a_missing_aggregate_aborts_the_caller_s_transaction(
    writer: Writer, db: Any, client: Any, sync_client: MongoClient[Any]
) -> None:
    # The docs promised it; the transaction stayed open, and a caller that caught the error
    # and went on committed its own writes without their events.
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    if writer.api == "async":
        async with client.start_session() as session:
            async with await session.start_transaction():
                await db.stock.insert_one({"_id": "sku"}, session=session)
                with pytest.raises(AggregateNotFoundError):
                    await writer.add_events(session, db.orders, 2, [Event(type="b")])
                assert not session.in_transaction
    else:

        def caught() -> None:
            with sync_client.start_session() as session, session.start_transaction():
                writer.sync_db.stock.insert_one({"_id": "sku"}, session=session)
                with pytest.raises(AggregateNotFoundError):
                    writer.outbox.add_events(session, writer.sync_db.orders, 2, [Event(type="b")])
                assert not session.in_transaction

        await asyncio.to_thread(caught)
    assert await db.stock.count_documents({}) == 0  # the caller's own write went with it
    assert await db.outbox.count_documents({}) == 1
