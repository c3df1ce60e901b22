"""Where an aggregate may be saved, and what it publishes as: one (aggregate_type, aggregate_id)
per document, in the outbox's own client and database only."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from bson import ObjectId
from pymongo import AsyncMongoClient

from mongo_outbox import (
    ConfigurationError,
    Event,
    InvalidAggregateError,
    InvalidEventError,
    Outbox,
    PollingRelay,
)
from mongo_outbox.publishers import MemoryPublisher
from tests.support.contents import contents
from tests.support.servers import MongoServer

MODES = ["collection", "embedded"]


def make_outbox(db: Any, mode: str, **options: Any) -> Outbox:
    return Outbox(db, mode=mode, collections=["orders", "customers"], **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", MODES)
async def test_a_namesake_database_of_another_client_is_refused_with_or_without_session(
    client: Any, db: Any, mongo: MongoServer, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    other: Any = AsyncMongoClient(mongo.uri, tz_aware=True)
    try:
        namesake = other[db.name].orders
        for session in (None, other.start_session(), client.start_session()):
            with pytest.raises(InvalidAggregateError) as caught:
                await outbox.save_with_events(session, namesake, {"_id": 1}, [Event(type="a")])
            assert caught.value.collection == "orders"
            if session is not None:
                await session.end_session()
    finally:
        await other.close()
    assert await contents(db) == {}


@pytest.mark.parametrize("mode", MODES)
async def test_a_motor_collection_is_refused_by_an_outbox_of_a_pymongo_database(
    db: Any, mongo: MongoServer, mode: str
) -> None:
    from motor.motor_asyncio import AsyncIOMotorClient

    motor: Any = AsyncIOMotorClient(mongo.uri)
    try:
        with pytest.raises(InvalidAggregateError):
            await make_outbox(db, mode).save_with_events(
                None, motor[db.name].orders, {"_id": 1}, [Event(type="a")]
            )
    finally:
        motor.close()
    assert await contents(db) == {}


@pytest.mark.parametrize("mode", MODES)
async def test_an_event_of_another_aggregate_type_is_refused(db: Any, mode: str) -> None:
    outbox = make_outbox(db, mode)
    await outbox.save_with_events(None, db.customers, {"_id": 1}, [Event(type="joined")])
    before = await contents(db)
    stray = Event(type="placed", aggregate_type="customers")
    with pytest.raises(InvalidEventError) as caught:
        await outbox.save_with_events(None, db.orders, {"_id": 1}, [stray])
    assert caught.value.event_id == stray.id
    assert await contents(db) == before
    publisher = MemoryPublisher()
    await PollingRelay(outbox, publisher).drain()
    assert [(e.aggregate_type, e.aggregate_id, e.sequence) for e in publisher.events] == [
        ("customers", 1, 1)
    ]


@pytest.mark.parametrize("mode", MODES)
async def test_aggregate_types_name_what_a_collection_publishes_as(db: Any, mode: str) -> None:
    outbox = make_outbox(db, mode, aggregate_types={"orders": "Order"})
    saved = await outbox.save_with_events(
        None, db.orders, {"_id": 1}, [Event(type="a"), Event(type="b", aggregate_type="Order")]
    )
    assert {e.aggregate_type for e in saved.events} == {"Order"}
    with pytest.raises(InvalidEventError):  # the collection's name is not its type any more
        await outbox.save_with_events(
            None, db.orders, {"_id": 1}, [Event(type="c", aggregate_type="orders")]
        )
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 2
    assert [(e.aggregate_type, e.sequence) for e in publisher.events] == [
        ("Order", 1),
        ("Order", 2),
    ]


async def test_aggregate_types_are_one_to_one_and_take_no_other_collections_name(db: Any) -> None:
    for mapping, collections in [
        ({"orders": "Order", "carts": "Order"}, ()),
        ({"orders": "customers", "customers": "Customer"}, ()),
        ({"orders": "customers"}, ("orders", "customers")),
        ({"orders": ""}, ()),
        ({"orders": 3}, ()),
        (["orders"], ()),
    ]:
        with pytest.raises(ConfigurationError) as caught:
            Outbox(db, collections=collections, aggregate_types=mapping)  # type: ignore[arg-type]
        assert caught.value.setting == "Outbox.aggregate_types"
    Outbox(db, aggregate_types={"orders": "orders", "carts": "Cart"})  # its own name is fine


async def test_a_collection_whose_name_another_collection_publishes_as_is_refused(
    db: Any,
) -> None:
    outbox = Outbox(db, aggregate_types={"orders": "customers"})
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    before = await contents(db)
    with pytest.raises(InvalidAggregateError) as caught:
        await outbox.save_with_events(None, db.customers, {"_id": 1}, [Event(type="b")])
    assert caught.value.collection == "customers"
    assert await contents(db) == before


@pytest.mark.parametrize("mode", MODES)
async def test_a_string_id_spelled_like_an_object_id_or_uuid_is_refused(db: Any, mode: str) -> None:
    outbox = make_outbox(db, mode)
    object_id = ObjectId()
    saved = await outbox.save_with_events(None, db.orders, {"_id": object_id}, [Event(type="a")])
    assert saved.events[0].aggregate_id == str(object_id)
    before = await contents(db)
    for spelled in (str(object_id), str(uuid.uuid4())):
        with pytest.raises(InvalidAggregateError, match="store the ObjectId or UUID itself"):
            await outbox.save_with_events(None, db.orders, {"_id": spelled}, [Event(type="b")])
    assert await contents(db) == before
    for fine in (str(object_id).upper(), "order-1", str(uuid.uuid4()).upper(), "1"):
        await outbox.save_with_events(None, db.orders, {"_id": fine}, [Event(type="c")])


async def test_uuid_ids_publish_as_their_string(mongo: MongoServer) -> None:
    standard: Any = AsyncMongoClient(mongo.uri, uuidRepresentation="standard", tz_aware=True)
    db = standard[f"t_{uuid.uuid4().hex[:12]}"]
    try:
        outbox = Outbox(db, mode="embedded", collections=["orders"])
        key = uuid.uuid4()
        await outbox.save_with_events(None, db.orders, {"_id": key}, [Event(type="a")])
        publisher = MemoryPublisher()
        await PollingRelay(outbox, publisher).drain()
        assert [(e.aggregate_id, e.sequence) for e in publisher.events] == [(str(key), 1)]
    finally:
        await standard.drop_database(db.name)
        await standard.close()
