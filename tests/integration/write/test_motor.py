"""Motor (deprecated upstream, still common) works unchanged, against the same server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mongo_outbox import Event, InvalidAggregateError, Outbox, PollingRelay
from mongo_outbox.publishers import MemoryPublisher
from tests.support.servers import MongoServer


@pytest.fixture
async def motor_db(mongo: MongoServer) -> AsyncIterator[Any]:
    from motor.motor_asyncio import AsyncIOMotorClient

    client: Any = AsyncIOMotorClient(mongo.uri, tz_aware=True)
    name = f"motor_{uuid.uuid4().hex[:10]}"
    yield client[name]
    await client.drop_database(name)
    client.close()


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_motor_database_session_and_relay(motor_db: Any, mode: str) -> None:
    client = motor_db.client
    outbox = Outbox(motor_db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    await outbox.save_with_events(None, motor_db.orders, {"_id": 1}, [Event(type="a")])
    async with await client.start_session() as session:
        await outbox.save_with_events(session, motor_db.orders, {"_id": 1}, [Event(type="b")])
        async with session.start_transaction():
            await motor_db.audit.insert_one({"_id": 1}, session=session)
            await outbox.save_with_events(
                session, motor_db.orders, {"_id": 2}, [Event(type="c")], expected_version=0
            )
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 3
    assert sorted((e.aggregate_id, e.sequence, e.type) for e in publisher.events) == [
        (1, 1, "a"),
        (1, 2, "b"),
        (2, 1, "c"),
    ]
    assert await motor_db.audit.count_documents({}) == 1


async def test_motor_session_of_another_client_is_refused(
    motor_db: Any, mongo: MongoServer
) -> None:
    from motor.motor_asyncio import AsyncIOMotorClient

    other: Any = AsyncIOMotorClient(mongo.uri)
    async with await other.start_session() as session:
        with pytest.raises(InvalidAggregateError):
            await Outbox(motor_db).save_with_events(session, motor_db.orders, {"_id": 1}, [])
    other.close()
    assert await motor_db.orders.count_documents({}) == 0


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_motor_updates_deletes_and_adds_events(motor_db: Any, mode: str) -> None:
    client = motor_db.client
    outbox = Outbox(motor_db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.update_with_events(
        None, motor_db.orders, {"_id": 1}, {"$set": {"n": 1}}, [Event(type="a")], upsert=True
    )
    await outbox.update_with_events(
        None, motor_db.orders, {"_id": 1}, [{"$set": {"n": 2}}], [Event(type="b")]
    )
    if mode == "collection":
        async with await client.start_session() as session:
            async with session.start_transaction():
                await motor_db.orders.update_one({"_id": 1}, {"$inc": {"n": 1}}, session=session)
                await outbox.add_events(session, motor_db.orders, 1, [Event(type="c")])
        await outbox.delete_with_events(None, motor_db.orders, {"_id": 1}, [Event(type="d")])
    publisher = MemoryPublisher()
    await PollingRelay(outbox, publisher).drain()
    expected = ["a", "b", "c", "d"] if mode == "collection" else ["a", "b"]
    assert [(e.type, e.sequence) for e in publisher.events] == [
        (kind, n) for n, kind in enumerate(expected, start=1)
    ]
