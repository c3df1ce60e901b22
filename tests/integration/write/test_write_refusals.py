"""What either write API refuses, through a real database: settings and objects the outbox cannot
work with are refused with a clear error before anything is written; a write the driver never
sent leaves no reservation and no mark behind; a save cancelled inside the caller's transaction
aborts it; two saves sharing one session at once are refused, not mixed. The same rules without
a database: tests/unit/test_write_rules.py."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from bson.binary import UuidRepresentation
from bson.codec_options import CodecOptions
from bson.errors import InvalidDocument
from bson.raw_bson import RawBSONDocument
from pydantic import ConfigDict, computed_field
from pymongo import AsyncMongoClient, MongoClient, WriteConcern
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.synchronous.collection import Collection

from mongo_outbox import (
    ConfigurationError,
    Event,
    InvalidAggregateError,
    InvalidEventError,
    Outbox,
    PollingRelay,
    UsageError,
)
from mongo_outbox.publishers import MemoryPublisher
from mongo_outbox.sync import Outbox as SyncOutbox
from tests.support.apis import APIS, Writer
from tests.support.cancelling import CancelsAtCommand
from tests.support.contents import contents

EMBEDDED = {"mode": "embedded", "collections": ["orders"]}


@pytest.mark.parametrize("api", APIS)
async def test_unacknowledged_writes_are_refused(
    api: str, db: Any, sync_client: MongoClient[Any]
) -> None:
    # w=0 cannot tell whether a write happened: a duplicate id unseen, a write taken for a miss.
    writer = Writer(api, db, sync_client, **EMBEDDED)
    unacknowledged = WriteConcern(w=0)
    with pytest.raises(InvalidAggregateError, match="unacknowledged"):
        if api == "async":
            orders = db.orders.with_options(write_concern=unacknowledged)
            await writer.outbox.save_with_events(None, orders, {"_id": 1}, [Event(type="a")])
        else:
            orders = writer.sync_db.orders.with_options(write_concern=unacknowledged)
            writer.outbox.save_with_events(None, orders, {"_id": 1}, [Event(type="a")])
    assert await contents(db) == {}
    # In a transaction the transaction's write concern counts, not the collection's.
    if api == "async":
        async with db.client.start_session() as session:
            async with await session.start_transaction():
                orders = db.orders.with_options(write_concern=unacknowledged)
                await writer.outbox.save_with_events(session, orders, {"_id": 2}, [])
        assert await db.orders.count_documents({"_id": 2}) == 1
    for database in (db, writer.sync_db):
        for options in ({}, EMBEDDED):
            outbox = Outbox if database is db else SyncOutbox
            with pytest.raises(ConfigurationError, match="unacknowledged") as caught:
                outbox(database.with_options(write_concern=unacknowledged), **options)
            assert caught.value.setting == "Outbox.db"


@pytest.mark.parametrize("field", ["meta.outbox", "$x", "", "_id", "_version", "x\x00y", 7])
def test_an_embedded_field_that_is_no_top_level_name_is_refused(
    sync_client: MongoClient[Any], field: Any
) -> None:
    # A dotted field: updates $push into a nested array the relay never reads.
    with pytest.raises(ConfigurationError) as caught:
        SyncOutbox(sync_client.shop, field=field, **EMBEDDED)
    assert caught.value.setting == "Outbox.field"


@pytest.mark.parametrize("api", APIS)
async def test_an_expected_version_beyond_64_bits_is_refused_before_any_reservation(
    api: str, db: Any, sync_client: MongoClient[Any]
) -> None:
    writer = Writer(api, db, sync_client, **EMBEDDED)
    await db.orders.insert_one({"_id": 1})
    before = await contents(db)
    chosen = Event(id="pay-42", type="paid")  # a chosen id is reserved before the write
    with pytest.raises(InvalidAggregateError, match="2\\*\\*63"):
        await writer.update_with_events(
            None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [chosen], expected_version=2**63
        )
    assert await contents(db) == before
    saved = await writer.save_with_events(None, db.orders, {"_id": 2}, [chosen])
    assert saved.events[0].id == "pay-42"


@pytest.mark.parametrize("api", APIS)
async def test_an_ended_session_is_refused_and_leaves_the_event_free(
    api: str, client: Any, db: Any, sync_client: MongoClient[Any]
) -> None:
    writer = Writer(api, db, sync_client, **EMBEDDED)
    if api == "async":
        session = client.start_session()
        await session.end_session()
    else:
        session = sync_client.start_session()
        session.end_session()
    event = Event(type="placed")
    with pytest.raises(UsageError, match="session has ended"):
        await writer.save_with_events(session, db.orders, {"_id": 1}, [event])
    assert await contents(db) == {}
    await writer.save_with_events(None, db.orders, {"_id": 2}, [event])  # not marked as saved


@pytest.mark.parametrize("api", APIS)
async def test_a_read_only_document_without_an_id_is_refused(
    api: str, db: Any, sync_client: MongoClient[Any]
) -> None:
    writer = Writer(api, db, sync_client)
    document = RawBSONDocument(b"\x0c\x00\x00\x00\x10n\x00\x01\x00\x00\x00\x00")  # {"n": 1}
    with pytest.raises(InvalidAggregateError, match="give it an _id"):
        await writer.save_with_events(None, db.orders, document, [Event(type="a")])  # type: ignore[arg-type]
    assert await contents(db) == {}


@pytest.mark.parametrize("api", APIS)
async def test_a_write_the_driver_refused_to_send_takes_its_reservations_back(
    api: str, db: Any, sync_client: MongoClient[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the driver raises while encoding the command wrote nothing: the event's id and the
    # object are free again, as after any refused write. The refusal is injected: the rules
    # refuse every such input they can see first.
    writer = Writer(api, db, sync_client, **EMBEDDED)
    await db.orders.insert_many([{"_id": 1}, {"_id": 2}])

    def unsent(*args: Any, **kwargs: Any) -> Any:
        raise InvalidDocument("cannot encode object")

    for collection_type in (AsyncCollection, Collection):
        monkeypatch.setattr(collection_type, "find_one_and_update", unsent)
    chosen = Event(id="pay-43", type="paid")
    with pytest.raises(InvalidDocument):
        await writer.update_with_events(None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [chosen])
    monkeypatch.undo()
    assert await db.outbox_event_ids.count_documents({}) == 0
    await writer.update_with_events(None, db.orders, {"_id": 2}, {"$set": {"x": 1}}, [chosen])
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.relay_outbox, publisher).drain() == 1
    assert [(e.id, e.aggregate_id) for e in publisher.events] == [("pay-43", 2)]


@pytest.mark.parametrize("api", APIS)
async def test_a_uuid_id_needs_its_representation_on_the_database_in_embedded_mode(
    api: str, db: Any, sync_client: MongoClient[Any]
) -> None:
    # The collection alone can encode it; the registry and the relay use the database's codec.
    writer = Writer(api, db, sync_client, **EMBEDDED)
    standard = CodecOptions(uuid_representation=UuidRepresentation.STANDARD)
    chosen = Event(id="uuid-1", type="placed")
    with pytest.raises(InvalidAggregateError, match="uuidRepresentation on the database"):
        if api == "async":
            orders = db.orders.with_options(codec_options=standard)
            await writer.outbox.save_with_events(None, orders, {"_id": uuid.uuid4()}, [chosen])
        else:
            orders = writer.sync_db.orders.with_options(codec_options=standard)
            writer.outbox.save_with_events(None, orders, {"_id": uuid.uuid4()}, [chosen])
    assert await contents(db) == {}
    # Without an id to reserve the registry is not written: such a save goes through.
    fresh = uuid.uuid4()
    if api == "async":
        await writer.outbox.save_with_events(None, orders, {"_id": fresh}, [Event(type="a")])
    else:
        writer.outbox.save_with_events(None, orders, {"_id": fresh}, [Event(type="a")])
    assert await db.orders.count_documents({}) == 1


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_a_save_cancelled_in_the_callers_transaction_aborts_it(mongo: Any, mode: str) -> None:
    # Cancelled once its document write was sent: nothing tells which of its writes happened,
    # and committing what did would store the change without its events (or count one write
    # twice after a retry). The transaction it joined is aborted.
    canceller = CancelsAtCommand("findAndModify")
    client: Any = AsyncMongoClient(mongo.uri, event_listeners=[canceller])
    db = client[f"t_{uuid.uuid4().hex[:12]}"]
    try:
        outbox = Outbox(db, mode=mode, collections=["orders"])
        await outbox.save_with_events(None, db.orders, {"_id": "o1", "n": 0}, [Event(type="a")])
        before = await contents(db)
        async with client.start_session() as session:
            await session.start_transaction()
            await db.lines.insert_one({"_id": 1}, session=session)  # the caller's own write
            save = asyncio.create_task(
                outbox.save_with_events(
                    session, db.orders, {"_id": "o1", "n": 1}, [Event(type="b")]
                )
            )
            canceller.task = save
            with pytest.raises(asyncio.CancelledError):
                await save
            assert not session.in_transaction
        assert await contents(db) == before
    finally:
        await client.drop_database(db.name)
        await client.close()


async def test_two_saves_sharing_one_session_at_once_are_refused_not_mixed(
    client: Any, db: Any
) -> None:
    # The first save starts a transaction on the session; the second would join it, and the
    # first one's refusal would abort the second's writes behind a returned Saved.
    outbox = Outbox(db)
    async with client.start_session() as session:
        results = await asyncio.gather(
            outbox.save_with_events(session, db.orders, {"_id": "A"}, [Event(type="a")]),
            outbox.save_with_events(session, db.orders, {"_id": "B"}, [Event(type="b")]),
            return_exceptions=True,
        )
    refused = [r for r in results if isinstance(r, UsageError)]
    assert len(refused) == 1 and "one task or thread at a time" in str(refused[0])
    [saved] = [r for r in results if not isinstance(r, BaseException)]
    assert await db.orders.count_documents({}) == 1
    assert await db.outbox.count_documents({"aggregate_id": saved.id}) == 1
    async with client.start_session() as session:  # one after the other: both fine
        for doc_id in ("C", "D"):
            await outbox.save_with_events(session, db.orders, {"_id": doc_id}, [Event(type="c")])
    assert await db.orders.count_documents({}) == 3


class OrderPlaced(Event):
    order_no: int = 0


class Computed(Event):
    @computed_field  # type: ignore[prop-decorator]
    @property
    def upper(self) -> str:
        return self.type.upper()


class Loose(Event):
    model_config = ConfigDict(extra="allow")


class Shorthand(Event):
    """A subclass without fields of its own: a helper method is all it adds."""

    def total(self) -> int:
        return int(self.payload.get("total", 0))  # type: ignore[arg-type]


@pytest.mark.parametrize("api", APIS)
async def test_an_event_subclass_with_fields_of_its_own_is_refused(
    api: str, db: Any, sync_client: MongoClient[Any]
) -> None:
    # The relay reads entries back as Event: order_no would be stored and never published.
    writer = Writer(api, db, sync_client)
    for event, key in (
        (OrderPlaced(type="placed", order_no=42), "order_no"),
        (Computed(type="placed"), "upper"),
        (Loose(type="placed", note="x"), "note"),
    ):
        with pytest.raises(InvalidEventError, match=key) as caught:
            await writer.save_with_events(None, db.orders, {"_id": 1}, [event])
        assert caught.value.event_id == event.id
    assert await contents(db) == {}
    await writer.save_with_events(
        None, db.orders, {"_id": 1}, [Shorthand(type="placed", payload={"total": 3})]
    )
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.relay_outbox, publisher).drain() == 1
    assert publisher.events[0].payload == {"total": 3}


@pytest.mark.parametrize("write", ["save", "update"])
async def test_a_stored_outbox_field_that_is_no_array_refuses_the_write(
    db: Any, write: str
) -> None:
    # Written by other code: the entries cannot be appended to it. The server refuses the
    # write; the outbox says which document, and nothing changes.
    outbox = Outbox(db, **EMBEDDED)
    await db.orders.insert_one({"_id": 1, "_outbox": "not an array", "_version": 1})
    before = await contents(db)
    with pytest.raises(InvalidAggregateError, match=r"refused the .* of orders 1"):
        if write == "save":
            await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="t")])
        else:
            await outbox.update_with_events(
                None, db.orders, {"_id": 1}, {"$set": {"a": 1}}, [Event(type="t")]
            )
    assert await contents(db) == before


@pytest.mark.parametrize(
    "update",
    [[{"$unset": []}], {"$set": {"a..b": 1}}, {"$unset": {".a": ""}}, [{"$unset": "a."}]],
    ids=["empty_unset_stage", "empty_segment", "leading_dot", "trailing_dot"],
)
async def test_an_update_with_no_field_path_is_refused_before_anything_is_written(
    db: Any, update: Any
) -> None:
    outbox = Outbox(db)
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [])
    before = await contents(db)
    with pytest.raises(InvalidAggregateError, match=r"is not a field path|is not accepted"):
        await outbox.update_with_events(None, db.orders, {"_id": 1}, update, [Event(type="t")])
    assert await contents(db) == before
