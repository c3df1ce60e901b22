"""mongo_outbox.sync stores what the async Outbox stores, byte for byte but for the clock, and the
async relays publish it to the real NATS unchanged."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import bson
import pytest
from pymongo import MongoClient

from mongo_outbox import ChangeStreamRelay, Event, PollingRelay, RelaySettings, Saved
from mongo_outbox.publishers import NatsPublisher
from tests.support.apis import Writer
from tests.support.contents import contents
from tests.support.messages import read_stream
from tests.support.servers import NATS_URL, MongoServer
from tests.support.waiting import until

MODES = ["collection", "embedded"]
# Written from the clock at the time of the write: equal in kind, not in value.
CLOCK_FIELDS = {"available_at", "_outbox_due", "expire_at"}


def options(mode: str) -> dict[str, Any]:
    return {"mode": mode, "collections": ["orders"]} if mode == "embedded" else {}


async def add_in_transaction(writer: Writer, client: Any, doc_id: Any, event: Event) -> Saved:
    """The caller's own write and add_events in one transaction, through ``writer``'s API."""
    if writer.api == "async":
        async with client.start_session() as session, await session.start_transaction():
            await writer.db.orders.update_one(
                {"_id": doc_id}, {"$set": {"seen": True}}, session=session
            )
            return await writer.add_events(session, writer.db.orders, doc_id, [event])

    def add() -> Saved:
        sync_client = writer.sync_db.client
        with sync_client.start_session() as session, session.start_transaction():
            writer.sync_db.orders.update_one(
                {"_id": doc_id}, {"$set": {"seen": True}}, session=session
            )
            saved: Saved = writer.outbox.add_events(session, writer.sync_db.orders, doc_id, [event])
            return saved

    return await asyncio.to_thread(add)


async def history(writer: Writer, client: Any, events: dict[str, Event]) -> list[Saved]:
    """Every kind of write, through ``writer``; ``events`` by name, the same for every API."""
    db = writer.db
    saved = [
        await writer.save_with_events(
            None, db.orders, {"_id": 1, "lines": ["a"]}, [events["placed"]], expected_version=0
        ),
        await writer.save_with_events(None, db.orders, {"_id": 2, "n": 0}, [events["other"]]),
        await writer.update_with_events(
            None,
            db.orders,
            {"_id": 1},
            {"$push": {"lines": "b"}, "$inc": {"total": 3}, "$set": {"status": "open"}},
            [events["line"], events["priced"]],
            expected_version=1,
        ),
        await writer.update_with_events(
            None, db.orders, {"_id": 2}, [{"$set": {"n": {"$add": ["$n", 1]}}}], [events["bumped"]]
        ),
        await writer.update_with_events(
            None, db.orders, {"_id": 3}, {"$set": {"x": 1}}, [events["upserted"]], upsert=True
        ),
    ]
    if writer.relay_outbox.mode == "collection":
        saved.append(await add_in_transaction(writer, client, 1, events["added"]))
        saved.append(
            await writer.delete_with_events(None, db.orders, {"_id": 2}, [events["deleted"]])
        )
    return saved


def named_events() -> dict[str, Event]:
    names = ["placed", "other", "line", "priced", "bumped", "upserted", "added", "deleted"]
    return {name: Event(type=f"order.{name}", payload={"name": name}) for name in names}


def without_clock(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "<clock>" if k in CLOCK_FIELDS else without_clock(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_clock(v) for v in value]
    return value


async def indexes(collection: Any) -> dict[str, Any]:
    found = await collection.index_information()
    return {name: {k: v for k, v in spec.items() if k != "ns"} for name, spec in found.items()}


@pytest.fixture
async def other_db(client: Any) -> AsyncIterator[Any]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield client[name]
    await client.drop_database(name)


@pytest.mark.parametrize("mode", MODES)
async def test_the_sync_api_stores_exactly_what_the_async_api_stores(
    client: Any, db: Any, other_db: Any, sync_client: MongoClient[Any], mode: str
) -> None:
    events = named_events()
    # The same events, each API its own objects: an object a save was given is reserved ever
    # after (docs/outbox.md), which would make the second history store more.
    copies = {name: event.model_copy() for name, event in events.items()}
    by_async = Writer("async", db, sync_client, **options(mode))
    by_sync = Writer("sync", other_db, sync_client, **options(mode))
    for writer in (by_async, by_sync):
        await writer.ensure_indexes()
    async_saved = await history(by_async, client, events)
    sync_saved = await history(by_sync, client, copies)
    assert async_saved == sync_saved
    stored_async, stored_sync = await contents(db), await contents(other_db)
    assert stored_async and without_clock(stored_async) == without_clock(stored_sync)
    # Field order too: the relays and other readers see the same documents.
    for name, documents in stored_async.items():
        for mine, theirs in zip(documents, stored_sync[name], strict=True):
            assert list(mine) == list(theirs)
            assert bson.encode(without_clock(mine)) == bson.encode(without_clock(theirs))
    for name in ("orders", "outbox", "outbox_event_ids"):
        assert await indexes(db[name]) == await indexes(other_db[name])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["polling", "changestream"])
async def test_the_async_relays_publish_what_the_sync_api_saved_to_nats(
    client: Any,
    db: Any,
    sync_client: MongoClient[Any],
    nats_client: Any,
    nats_stream: str,
    mode: str,
    kind: str,
) -> None:
    writer = Writer("sync", db, sync_client, **options(mode))
    await writer.ensure_indexes()
    saved = await history(writer, client, named_events())
    committed = [e for s in saved for e in s.events]
    publisher = await NatsPublisher.connect(
        NATS_URL, subject=f"{nats_stream}.{{aggregate_type}}.{{type}}"
    )
    try:
        if kind == "polling":
            assert await PollingRelay(writer.relay_outbox, publisher).drain() == len(committed)
        else:
            relay = ChangeStreamRelay(
                writer.relay_outbox,
                publisher,
                name=f"sync-{mode}",
                settings=RelaySettings(batch_size=4),
                leader_lease=30.0,
            )
            task = asyncio.create_task(relay.run())
            try:
                js = nats_client.jetstream()

                async def published(count: int) -> bool:
                    return bool((await js.stream_info(nats_stream)).state.messages >= count)

                await until(lambda: published(len(committed)), timeout=30)
                if mode == "embedded":  # saved while the relay follows the stream
                    later = await writer.update_with_events(
                        None, db.orders, {"_id": 1}, {"$inc": {"total": 1}}, [Event(type="later")]
                    )
                    committed += later.events
                    await until(lambda: published(len(committed)), timeout=30)
            finally:
                relay.stop()
                await asyncio.wait_for(task, 30)
    finally:
        await publisher.aclose()
    messages = await read_stream(nats_client, nats_stream, len(committed))
    received = [Event.from_json(m.data) for m in messages]
    assert all(m.headers["Nats-Msg-Id"] == e.id for m, e in zip(messages, received, strict=True))
    assert sorted(received, key=lambda e: e.id) == sorted(committed, key=lambda e: e.id)
    for aggregate in {e.aggregate_id for e in committed}:
        numbers = [e.sequence for e in received if e.aggregate_id == aggregate]
        assert numbers == list(range(1, len(numbers) + 1)), aggregate


def test_the_sync_outbox_refuses_collections_and_sessions_of_other_clients(
    client: Any, sync_client: MongoClient[Any], mongo: MongoServer
) -> None:
    from mongo_outbox import InvalidAggregateError
    from mongo_outbox.sync import Outbox as SyncOutbox

    shop = sync_client[f"t_{uuid.uuid4().hex[:12]}"]
    outbox = SyncOutbox(shop)
    other: MongoClient[Any] = MongoClient(mongo.uri)
    try:
        with other.start_session() as session:
            writes: list[Callable[[], object]] = [
                lambda: outbox.save_with_events(None, client[shop.name].orders, {"_id": 1}, []),
                lambda: outbox.update_with_events(
                    None, other[shop.name].orders, {"_id": 1}, {"$set": {"a": 1}}, []
                ),
                lambda: outbox.delete_with_events(session, shop.orders, {"_id": 1}, []),
            ]
            for write in writes:
                with pytest.raises(InvalidAggregateError):
                    write()
        assert shop.list_collection_names() == []
    finally:
        other.close()
        sync_client.drop_database(shop.name)


def test_each_outbox_refuses_a_database_of_the_other_api(
    client: Any, sync_client: MongoClient[Any], mongo: MongoServer
) -> None:
    # Built over the other API's database, its calls would hand back coroutines never awaited
    # (or block the event loop): refused when the outbox is built, before anything is written.
    from motor.motor_asyncio import AsyncIOMotorClient

    from mongo_outbox import Outbox, UsageError
    from mongo_outbox.sync import Outbox as SyncOutbox

    name = f"t_{uuid.uuid4().hex[:12]}"
    motor: Any = AsyncIOMotorClient(mongo.uri, connect=False)
    try:
        for database in (client[name], motor[name]):
            with pytest.raises(UsageError, match="sync API: give it a Database"):
                SyncOutbox(database, mode="embedded", collections=["orders"])
        with pytest.raises(UsageError, match="is async: give it an AsyncDatabase"):
            Outbox(sync_client[name])
        Outbox(motor[name])  # Motor's database is async too
        # A collection or a client answers any attribute, so it passed for a database: a sync
        # outbox over db.orders made indexes in "orders.outbox" and refused writes confusingly.
        for given, kind in [
            (sync_client[name].orders, "collection"),
            (client[name].orders, "collection"),
            (motor[name].orders, "collection"),
            (sync_client, "client"),
            (client, "client"),
            (motor, "client"),
        ]:
            for api in (Outbox, SyncOutbox):
                with pytest.raises(UsageError, match=f"not a {kind}"):
                    api(given)
    finally:
        motor.close()
