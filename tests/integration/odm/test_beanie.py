"""Beanie documents saved with their events through ``BeanieOutbox``, on the real Beanie, in both
modes: the document and its events in one write, Beanie's validation, actions and revision_id
kept, the outbox's fields invisible to the model, typed payloads read back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from beanie import (
    BulkWriter,
    Document,
    Insert,
    Link,
    Save,
    Update,
    WriteRules,
    after_event,
    before_event,
    init_beanie,
)
from beanie.exceptions import RevisionIdWasChanged
from beanie.odm.operators.update.array import Push
from bson import ObjectId
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pymongo import AsyncMongoClient
from pymongo.errors import OperationFailure

from mongo_outbox import (
    AggregateNotFoundError,
    ConcurrencyError,
    ConfigurationError,
    DuplicateSequenceError,
    Event,
    InvalidAggregateError,
    InvalidEventError,
    Outbox,
    PollingRelay,
    UsageError,
)
from mongo_outbox.odm.beanie import BeanieOutbox, RevisionConflictError
from mongo_outbox.publishers import MemoryPublisher
from tests.support.servers import MongoServer

MODES = ["collection", "embedded"]
HOOKS: list[str] = []


class OrderPlaced(BaseModel):
    """An ODM-free payload: what consumers read back with payload_as."""

    total: int


class Order(Document):
    customer: str = Field(min_length=1)
    total: int = Field(ge=0)
    lines: list[str] = Field(default_factory=list)
    placed_by: str | None = Field(default=None, alias="placedBy")
    version: int = Field(default=0, alias="_version", exclude=True)

    class Settings:
        name = "orders"
        validate_on_save = True

    @before_event(Insert)
    def on_insert(self) -> None:
        HOOKS.append("before insert")

    @before_event(Save)
    def on_save(self) -> None:
        HOOKS.append("before save")
        self.customer = self.customer.strip()

    @before_event(Update)
    def on_update(self) -> None:
        HOOKS.append("before update")

    @after_event(Save)
    def saved(self) -> None:
        HOOKS.append("after save")


class Ticket(Document):
    """A custom _id type and Beanie's optimistic concurrency."""

    id: uuid.UUID = Field(default_factory=uuid.uuid4)  # type: ignore[assignment]
    title: str

    class Settings:
        name = "tickets"
        use_revision = True


@pytest.fixture
async def models(db: Any, mongo: MongoServer) -> AsyncIterator[Any]:
    """The test's database on a client that stores UUIDs as Beanie does (``standard``)."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, tz_aware=True, uuidRepresentation="standard"
    )
    await init_beanie(database=client[db.name], document_models=[Order, Ticket])
    HOOKS.clear()
    yield client[db.name]
    await client.close()


def outbox_of(db: Any, mode: str) -> BeanieOutbox:
    outbox = Outbox(db, mode=mode, collections=["orders", "tickets"])  # type: ignore[arg-type]
    return BeanieOutbox(outbox)


@pytest.mark.parametrize("mode", MODES)
async def test_a_saved_document_and_its_events_load_back_in_beanie(models: Any, mode: str) -> None:
    orders = outbox_of(models, mode)
    order = Order(customer=" ada ", total=10, placedBy="web")
    saved = await orders.save(order, [Event.of(OrderPlaced(total=10), type="order.placed")])
    assert isinstance(order.id, ObjectId) and saved.id == order.id and saved.version == 1
    assert order.version == 1 and order.customer == "ada"  # the Save action ran before the write
    stored = await models.orders.find_one({"_id": order.id})
    assert stored["placedBy"] == "web" and stored["_version"] == 1  # Beanie's alias, as Beanie
    loaded = await Order.get(order.id)
    assert loaded is not None and loaded.total == 10 and loaded.version == 1
    loaded.total = 12
    await orders.save(loaded, [Event(type="order.repriced")], expected_version=1)
    await loaded.save()  # Beanie's own save keeps the outbox's fields
    again = await models.orders.find_one({"_id": order.id})
    assert again["_version"] == 2 and again["total"] == 12
    if mode == "embedded":
        assert [e["type"] for e in again["_outbox"]] == ["order.placed", "order.repriced"]
    publisher = MemoryPublisher()
    assert await PollingRelay(orders.outbox, publisher).drain() == 2
    first = publisher.events[0]
    assert (first.aggregate_id, first.sequence) == (str(order.id), 1)  # an ObjectId as JSON
    assert first.payload_as(OrderPlaced) == OrderPlaced(total=10)


@pytest.mark.parametrize("mode", MODES)
async def test_actions_run_as_beanie_runs_them(models: Any, mode: str) -> None:
    orders = outbox_of(models, mode)
    order = Order(customer="ada", total=1)
    await orders.insert(order, [Event(type="order.placed")])
    await orders.save(order, [Event(type="order.saved")])
    await orders.set(order, {Order.total: 5}, [Event(type="order.repriced")])
    assert HOOKS == [
        "before insert",
        "before save",
        "before update",
        "after save",
        "before update",
    ]


@pytest.mark.parametrize("mode", MODES)
async def test_an_invalid_document_writes_nothing(models: Any, mode: str) -> None:
    orders = outbox_of(models, mode)
    order = Order(customer="ada", total=1)
    order.total = -1  # pydantic does not validate assignment: Beanie validates on save
    with pytest.raises(ValidationError):
        await orders.save(order, [Event(type="order.placed")])
    assert await models.orders.count_documents({}) == 0
    assert await models.outbox.count_documents({}) == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_refused_save_leaves_a_new_document_without_an_id(models: Any, mode: str) -> None:
    orders = outbox_of(models, mode)
    order = Order(customer="ada", total=1)
    with pytest.raises(ConcurrencyError):
        await orders.save(order, [Event(type="order.placed")], expected_version=3)
    assert order.id is None and order.version == 0
    await orders.save(order, [Event(type="order.placed")])
    assert order.id is not None and order.version == 1


@pytest.mark.parametrize("mode", MODES)
async def test_a_refused_insert_leaves_the_revision_the_stored_document_has(
    models: Any, mode: str
) -> None:
    tickets = outbox_of(models, mode)
    ticket = Ticket(title="printer")
    await tickets.insert(ticket, [Event(type="ticket.opened")])
    stored = ticket.revision_id
    with pytest.raises(ConcurrencyError):  # it exists: an insert is a create
        await tickets.insert(ticket, [Event(type="ticket.opened")])
    with pytest.raises(InvalidEventError):
        await tickets.insert(Ticket(title="x"), ["not an event"])  # type: ignore[list-item]
    assert ticket.revision_id == stored
    # So its next save is not taken for a conflict with itself.
    saved = await tickets.save(ticket, [Event(type="ticket.renamed")])
    assert saved.version == 2


@pytest.mark.parametrize("mode", MODES)
async def test_updates_with_beanie_operators_refresh_the_document(models: Any, mode: str) -> None:
    orders = outbox_of(models, mode)
    order = Order(customer="ada", total=1)
    await orders.insert(order, [Event(type="order.placed")])
    saved = await orders.update(
        order, Push({Order.lines: "book"}), {"$inc": {"total": 4}}, events=[Event(type="added")]
    )
    assert saved.version == 2 and order.version == 2
    assert (order.lines, order.total) == (["book"], 5)
    await orders.inc(order, {Order.total: 1}, [Event(type="bumped")], expected_version=2)
    with pytest.raises(ConcurrencyError):
        await orders.inc(order, {Order.total: 1}, [Event(type="bumped")], expected_version=2)
    assert (await Order.get(order.id)).total == 6  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", MODES)
async def test_revision_id_guards_the_save_as_beanie_does(models: Any, mode: str) -> None:
    tickets = outbox_of(models, mode)
    ticket = Ticket(title="printer")
    await tickets.save(ticket, [Event(type="ticket.opened")])
    assert isinstance(ticket.id, uuid.UUID) and ticket.revision_id is not None
    stale = await Ticket.get(ticket.id)
    assert stale is not None and stale.revision_id == ticket.revision_id
    ticket.title = "printer on fire"
    await tickets.save(ticket, [Event(type="ticket.retitled")])
    stale.title = "scanner"
    with pytest.raises(RevisionIdWasChanged) as caught:
        await tickets.save(stale, [Event(type="ticket.retitled")])
    assert isinstance(caught.value, RevisionConflictError)
    with pytest.raises(RevisionConflictError):
        await tickets.set(stale, {Ticket.title: "scanner"}, [Event(type="ticket.retitled")])
    stored = await Ticket.get(ticket.id)
    assert stored is not None and stored.title == "printer on fire"
    await tickets.save(stale, [Event(type="ticket.forced")], ignore_revision=True)
    assert (await Ticket.get(ticket.id)).title == "scanner"  # type: ignore[union-attr]


async def test_delete_records_its_event_in_collection_mode(models: Any) -> None:
    orders = outbox_of(models, "collection")
    order = Order(customer="ada", total=1)
    await orders.insert(order, [Event(type="order.placed")])
    deleted = await orders.delete(order, [Event(type="order.deleted")], expected_version=1)
    assert deleted.version == 2 and await Order.get(order.id) is None
    assert await models.outbox.count_documents({"aggregate_id": str(order.id)}) == 2
    with pytest.raises(UsageError):
        await outbox_of(models, "embedded").delete(order, [Event(type="order.deleted")])


async def test_a_save_joins_the_callers_transaction(models: Any) -> None:
    orders = outbox_of(models, "collection")
    order = Order(customer="ada", total=1)
    async with models.client.start_session() as session:
        async with await session.start_transaction():
            await orders.insert(order, [Event(type="order.placed")], session=session)
            await session.abort_transaction()
    assert await models.orders.count_documents({}) == 0
    assert await models.outbox.count_documents({}) == 0


class Stock(Document):
    """Not validated on save: a stored quantity below zero is refused only when read back."""

    sku: str
    qty: int = Field(ge=0)
    version: int = Field(default=0, alias="_version", exclude=True)

    class Settings:
        name = "stock"
        use_revision = True


class CheckedStock(Document):
    sku: str
    version: int = Field(default=0, alias="_version", exclude=True)

    class Settings:
        name = "checked_stock"
        use_revision = True
        validate_on_save = True


@pytest.fixture
async def stock(models: Any) -> BeanieOutbox:
    await init_beanie(database=models, document_models=[Stock, CheckedStock])
    return BeanieOutbox(Outbox(models))


async def test_validation_on_save_keeps_the_version_and_the_revision(stock: BeanieOutbox) -> None:
    item = CheckedStock(sku="pen")
    await stock.save(item, [Event(type="stocked")])
    loaded = await CheckedStock.get(item.id)
    assert loaded is not None and loaded.version == 1
    with pytest.raises(ConcurrencyError):
        await stock.save(loaded, [Event(type="renamed")], expected_version=5)
    # Beanie's validation rebuilds the model: the excluded version went back to 0, and the
    # revision_id to None, which the guard then took for a conflict, every time.
    assert loaded.version == 1
    assert (await stock.save(loaded, [Event(type="renamed")], expected_version=1)).version == 2
    assert (await stock.save(loaded, [Event(type="renamed")])).version == 3


@pytest.mark.parametrize("mode", MODES)
async def test_an_update_the_model_refuses_raises_before_the_commit_and_writes_nothing(
    models: Any, mode: str
) -> None:
    await init_beanie(database=models, document_models=[Stock])
    stock = BeanieOutbox(Outbox(models, mode=mode, collections=["stock"]))  # type: ignore[arg-type]
    item = Stock(sku="pen", qty=3)
    await stock.insert(item, [Event(type="stocked")])
    revision = item.revision_id
    async with models.client.start_session() as session:
        await session.start_transaction()
        await models.shelf.insert_one({"_id": "pen"}, session=session)
        with pytest.raises(ValidationError):  # qty 3 - 5 is below 0, read back before commit
            await stock.inc(item, {Stock.qty: -5}, [Event(type="taken")], session=session)
        # Aborted: a commit would have stored what the model cannot load, with its event.
        assert not session.in_transaction
    assert await models.shelf.count_documents({}) == 0
    if mode == "collection":  # a transaction of its own, without a session
        with pytest.raises(ValidationError):
            await stock.inc(item, {Stock.qty: -5}, [Event(type="taken")])
        # It used to be committed with its event, then refused on load: a caller who retried
        # sent the event twice.
        assert [e["type"] async for e in models.outbox.find()] == ["stocked"]
    stored = await models.stock.find_one({"_id": item.id})
    assert (stored["qty"], stored["_version"]) == (3, 1)
    assert (item.qty, item.version, item.revision_id) == (3, 1, revision)
    await stock.inc(item, {Stock.qty: -2}, [Event(type="taken")])
    assert (item.qty, item.version) == (1, 2)


async def test_an_embedded_update_the_model_refuses_stands_and_is_not_raised(
    models: Any, caplog: pytest.LogCaptureFixture
) -> None:
    await init_beanie(database=models, document_models=[Stock])
    stock = BeanieOutbox(Outbox(models, mode="embedded", collections=["stock"]))
    item = Stock(sku="pen", qty=3)
    await stock.insert(item, [Event(type="stocked")])
    # One single-document write, stored before it can be read back: raising now would tell
    # the caller that nothing happened.
    saved = await stock.inc(item, {Stock.qty: -5}, [Event(type="taken")])
    stored = await models.stock.find_one({"_id": item.id})
    assert (saved.version, stored["qty"], len(stored["_outbox"])) == (2, -2, 2)
    assert "could not be read back" in caplog.text
    # The document keeps what it held, its revision and version too: its save is a conflict,
    # never an overwrite of the stored quantity behind the event that took it.
    assert (item.qty, item.version) == (3, 1)
    item.sku = "blue pen"
    with pytest.raises(RevisionConflictError):
        await stock.save(item, [Event(type="renamed")])
    with pytest.raises(ConcurrencyError):
        await stock.save(item, [Event(type="renamed")], ignore_revision=True, expected_version=1)
    assert (await models.stock.find_one({"_id": item.id}))["qty"] == -2


async def test_a_save_of_a_document_deleted_meanwhile_does_not_create_it_again(
    stock: BeanieOutbox, models: Any
) -> None:
    item = Stock(sku="pen", qty=3)
    await stock.insert(item, [Event(type="stocked")])
    stale = await Stock.get(item.id)
    assert stale is not None
    await stock.delete(item, [Event(type="discontinued")])
    stale.qty = 2
    with pytest.raises(AggregateNotFoundError):
        await stock.save(stale, [Event(type="taken")])
    assert await models.stock.count_documents({}) == 0
    # Its events would have started again at sequence 1, behind the deletion's 2.
    assert [e["sequence"] async for e in models.outbox.find().sort("sequence", 1)] == [1, 2]


async def test_a_stale_save_in_the_callers_transaction_is_a_revision_conflict(
    stock: BeanieOutbox, models: Any
) -> None:
    item = Stock(sku="pen", qty=3)
    await stock.insert(item, [Event(type="stocked")])
    stale = await Stock.get(item.id)
    assert stale is not None
    item.qty = 2
    await stock.save(item, [Event(type="taken")])
    stale.qty = 1
    # The refused write aborted the transaction (its upsert hit the stored _id): the conflict
    # must be told without another read in it.
    with pytest.raises(RevisionConflictError):
        async with models.client.start_session() as session:
            async with await session.start_transaction():
                await stock.save(stale, [Event(type="taken")], session=session)
    assert (await models.stock.find_one({"_id": item.id}))["qty"] == 2


class Loose(Document):
    """Keeps the fields it does not declare: the outbox's among them, as extras."""

    model_config = ConfigDict(extra="allow")
    name: str

    class Settings:
        name = "loose"


class Exposed(Document):
    name: str
    version: int = Field(default=0, alias="_version")  # not excluded: Beanie sends it back

    class Settings:
        name = "exposed"


class Declared(Document):
    """extra="allow", with the outbox's fields (of collection mode) declared and excluded."""

    model_config = ConfigDict(extra="allow")
    name: str
    version: int = Field(default=0, alias="_version", exclude=True)
    sequence: int = Field(default=0, alias="_sequence", exclude=True)

    class Settings:
        name = "declared"


@pytest.fixture
async def loose(models: Any) -> Any:
    await init_beanie(database=models, document_models=[Loose, Exposed, Declared])
    return models


@pytest.mark.parametrize("mode", MODES)
async def test_a_model_whose_own_saves_would_send_the_outbox_fields_back_is_refused(
    loose: Any, mode: str
) -> None:
    outbox = Outbox(loose, mode=mode, collections=["loose", "exposed"])  # type: ignore[arg-type]
    writer = BeanieOutbox(outbox)
    document = Loose(name="a")
    # Beanie's own save() of a stale copy wrote back the _version and _sequence it loaded as
    # extras (in embedded mode _outbox too): counters rolled back, a pending event erased.
    with pytest.raises(ConfigurationError, match=r"Loose has extra='allow'") as refused:
        await writer.save(document, [Event(type="created")])
    assert refused.value.setting == "Loose.model_config['extra']"
    with pytest.raises(ConfigurationError):
        await writer.insert(document, [Event(type="created")])
    with pytest.raises(ConfigurationError):  # checked first: its missing id is not the news
        await writer.set(document, {"name": "b"}, [Event(type="renamed")])
    with pytest.raises(ConfigurationError, match=r"Exposed.version is stored as _version"):
        await writer.save(Exposed(name="a"), [Event(type="created")])
    assert await loose.loose.count_documents({}) == 0
    assert await loose.exposed.count_documents({}) == 0
    assert await loose.outbox.count_documents({}) == 0


async def test_extra_allow_with_the_outbox_fields_declared_excluded_keeps_them(
    loose: Any,
) -> None:
    writer = BeanieOutbox(Outbox(loose))
    document = Declared(name="a")
    await writer.save(document, [Event(type="created")])
    stale = await Declared.get(document.id)
    assert stale is not None and stale.model_extra == {}
    document.name = "b"
    await writer.save(document, [Event(type="renamed")])
    stale.name = "c"
    await stale.save()  # Beanie's own save: not the counters
    stored = await loose.declared.find_one({"_id": document.id})
    assert (stored["name"], stored["_version"], stored["_sequence"]) == ("c", 2, 2)
    saved = await writer.save(document, [Event(type="renamed")])
    assert (saved.version, saved.events[0].sequence) == (3, 3)


async def test_a_save_after_beanies_own_replace_is_refused_in_collection_mode(
    models: Any,
) -> None:
    orders = outbox_of(models, "collection")
    order = Order(customer="ada", total=1)
    await orders.save(order, [Event(type="order.placed")])
    order.total = 2
    await order.replace()  # the model's fields alone: the outbox's counters are gone
    with pytest.raises(DuplicateSequenceError, match="up to sequence 1"):
        await orders.save(order, [Event(type="order.repriced")])
    # Its events used to start again at sequence 1, beside the first one's.
    assert [e["sequence"] async for e in models.outbox.find()] == [1]
    assert (await models.orders.find_one({"_id": order.id}))["total"] == 2


class Shelf(Document):
    """No revision: concurrent updates of copies meet at the write, not at a guard."""

    qty: int = Field(ge=0)

    class Settings:
        name = "shelves"


async def test_two_copies_taking_more_than_is_left_at_once_store_one_take(models: Any) -> None:
    await init_beanie(database=models, document_models=[Shelf])
    shelves = BeanieOutbox(Outbox(models))
    shelf = Shelf(qty=3)
    await shelves.insert(shelf, [Event(type="stocked")])
    copies = [await Shelf.get(shelf.id) for _ in range(2)]
    results = await asyncio.gather(
        *(
            shelves.inc(copy, {Shelf.qty: -2}, [Event(type="taken")])  # type: ignore[arg-type]
            for copy in copies
        ),
        return_exceptions=True,
    )
    # Whichever wrote second read 1 - 2 back in its transaction, and stored nothing.
    assert sorted(type(r).__name__ for r in results) == ["Saved", "ValidationError"]
    assert (await models.shelves.find_one({"_id": shelf.id}))["qty"] == 1
    assert [e["type"] async for e in models.outbox.find()] == ["stocked", "taken"]


@pytest.mark.parametrize("mode", MODES)
async def test_writes_in_an_aborted_transaction_are_made_again_by_their_retry(
    stock: BeanieOutbox, models: Any, mode: str
) -> None:
    stock = BeanieOutbox(Outbox(models, mode=mode, collections=["stock"]))  # type: ignore[arg-type]
    item, other = Stock(sku="pen", qty=3), Stock(sku="ink", qty=1)
    await stock.insert(item, [Event(type="stocked")])
    await stock.insert(other, [Event(type="stocked")])
    loaded, fresh = await Stock.get(item.id), Stock(sku="cap", qty=1)
    assert loaded is not None
    loaded.qty = 2
    taken, stocked, more = Event(type="taken"), Event(type="stocked"), Event(type="more")
    for attempt in ("aborted", "retried"):
        async with models.client.start_session() as session:
            await session.start_transaction()
            await stock.save(loaded, [taken], session=session, expected_version=loaded.version)
            await stock.insert(fresh, [stocked], session=session)
            await stock.inc(other, {Stock.qty: 5}, [more], session=session)
            if attempt == "aborted":
                await session.abort_transaction()
            else:
                await session.commit_transaction()
    # The retries used to be refused: the aborted writes had given the documents the
    # revision_id and version they wrote, which the stored ones never got (RevisionConflictError,
    # ConcurrencyError), and taken the new one for a stored one (AggregateNotFoundError).
    stored = {d["_id"]: (d["qty"], d["_version"]) async for d in models.stock.find()}
    assert stored == {item.id: (2, 2), fresh.id: (1, 1), other.id: (6, 2)}
    publisher = MemoryPublisher()
    assert await PollingRelay(stock.outbox, publisher).drain() == 5
    sent = {e.id: (e.aggregate_id, e.sequence) for e in publisher.events}
    assert len(sent) == 5  # each once
    assert sent[taken.id] == (str(item.id), 2) and sent[more.id] == (str(other.id), 2)
    assert sent[stocked.id] == (str(fresh.id), 1)
    # Until the commit is known, the documents keep their guards: after it, load them again.
    assert (loaded.version, other.version, other.qty) == (1, 1, 6)
    with pytest.raises(RevisionConflictError):
        await stock.save(loaded, [Event(type="checked")])
    again = await Stock.get(item.id)
    assert again is not None
    assert (await stock.save(again, [Event(type="checked")], expected_version=2)).version == 3


async def test_with_transaction_retries_a_save_whose_transaction_failed(
    stock: BeanieOutbox, models: Any
) -> None:
    item = Stock(sku="pen", qty=3)
    await stock.insert(item, [Event(type="stocked")])
    item.qty = 2
    taken = Event(type="taken")
    tries = 0

    async def take(session: Any) -> None:
        nonlocal tries
        tries += 1
        await stock.save(item, [taken], session=session, expected_version=item.version)
        if tries == 1:  # as a write conflict on a later write of the callback would
            conflict = OperationFailure("write conflict", code=112)
            conflict._add_error_label("TransientTransactionError")
            raise conflict

    async with models.client.start_session() as session:
        await session.with_transaction(take)
    assert tries == 2
    stored = await models.stock.find_one({"_id": item.id})
    assert (stored["qty"], stored["_version"]) == (2, 2)
    assert [e["type"] async for e in models.outbox.find().sort("sequence", 1)] == [
        "stocked",
        "taken",
    ]


class Profile(Document):
    """State management on, no revision: concurrent saves of copies meet at the fields."""

    name: str
    city: str = "paris"
    note: str | None = None
    version: int = Field(default=0, alias="_version", exclude=True)

    class Settings:
        name = "profiles"
        use_state_management = True


class Contact(Document):
    """State management with keep_nulls off: a None field is not stored."""

    email: str | None = None
    phone: str | None = None

    class Settings:
        name = "contacts"
        use_state_management = True
        keep_nulls = False


class Badge(Document):
    """State management and Beanie's revision guard."""

    label: str

    class Settings:
        name = "badges"
        use_state_management = True
        use_revision = True


@pytest.fixture
async def profiles(models: Any) -> Any:
    await init_beanie(database=models, document_models=[Profile, Contact, Badge, Stock])
    return models


def writer_of(db: Any, mode: str) -> BeanieOutbox:
    collections = ["profiles", "badges"]
    return BeanieOutbox(Outbox(db, mode=mode, collections=collections))  # type: ignore[arg-type]


async def published(writer: BeanieOutbox) -> list[tuple[str, str, int]]:
    publisher = MemoryPublisher()
    await PollingRelay(writer.outbox, publisher).drain()
    return sorted((e.type, e.aggregate_id, e.sequence) for e in publisher.events)


@pytest.mark.parametrize("mode", MODES)
async def test_two_save_changes_of_one_document_at_once_keep_both_writes_and_events(
    profiles: Any, mode: str
) -> None:
    writer = writer_of(profiles, mode)
    profile = Profile(name="ada")
    await writer.insert(profile, [Event(type="joined")])
    first, second = await Profile.get(profile.id), await Profile.get(profile.id)
    assert first is not None and second is not None
    first.name, second.city = "ada l.", "london"
    results = await asyncio.gather(
        writer.save_changes(first, [Event(type="renamed")]),
        writer.save_changes(second, [Event(type="moved")]),
    )
    # Each wrote its own field only: a whole-document save of either copy would have put the
    # other's field back as it was loaded.
    assert sorted(r.version for r in results) == [2, 3]
    stored = await profiles.profiles.find_one({"_id": profile.id})
    assert (stored["name"], stored["city"], stored["_version"]) == ("ada l.", "london", 3)
    # Each is read back as it stood after its write, as Beanie's update: the later has both.
    later = first if results[0].version == 3 else second
    assert (later.name, later.city, later.version) == ("ada l.", "london", 3)
    aggregate = str(profile.id)
    assert await published(writer) == [
        ("joined", aggregate, 1),
        *sorted(
            [("moved", aggregate, r.version) for r in results if r.events[0].type == "moved"]
            + [("renamed", aggregate, r.version) for r in results if r.events[0].type == "renamed"]
        ),
    ]


async def test_save_changes_writes_none_only_to_the_fields_that_became_none(profiles: Any) -> None:
    writer = writer_of(profiles, "collection")
    profile = Profile(name="ada", note="vip")
    await writer.insert(profile, [Event(type="joined")])
    profile.note = None
    await writer.save_changes(profile, [Event(type="unmarked")])
    assert (await profiles.profiles.find_one({"_id": profile.id}))["note"] is None  # keep_nulls
    fresh = await Profile.get(profile.id)
    assert fresh is not None
    fresh.note = "new"
    await writer.save_changes(fresh, [Event(type="marked")])
    profile.city = "rome"  # its note is None, unchanged: another writer's note stays
    await writer.save_changes(profile, [Event(type="moved")])
    stored = await profiles.profiles.find_one({"_id": profile.id})
    assert (stored["note"], stored["city"], stored["_version"]) == ("new", "rome", 4)


async def test_save_changes_of_an_unchanged_document_records_its_events(profiles: Any) -> None:
    writer = writer_of(profiles, "collection")
    profile = Profile(name="ada")
    await writer.save_changes(profile, [Event(type="joined")])  # never saved: saved whole
    profile.name = "bob"
    await profiles.profiles.update_one({"_id": profile.id}, {"$set": {"city": "oslo"}})
    saved = await writer.save_changes(
        (await Profile.get(profile.id)) or profile, [Event(type="checked")]
    )
    stored = await profiles.profiles.find_one({"_id": profile.id})
    assert (stored["name"], stored["city"], saved.version) == ("ada", "oslo", 2)
    assert [e[0] for e in await published(writer)] == ["checked", "joined"]


async def test_two_save_changes_of_one_field_meet_at_the_guard(profiles: Any) -> None:
    writer = writer_of(profiles, "collection")
    badge = Badge(label="new")
    await writer.insert(badge, [Event(type="issued")])
    copies = [await Badge.get(badge.id) for _ in range(2)]
    for copy_, label in zip(copies, ["gold", "silver"], strict=True):
        assert copy_ is not None
        copy_.label = label
    results = await asyncio.gather(
        *(writer.save_changes(c, [Event(type="relabelled")]) for c in copies if c is not None),
        return_exceptions=True,
    )
    assert sorted(type(r).__name__ for r in results) == ["RevisionConflictError", "Saved"]
    winner = next(c for c, r in zip(copies, results, strict=True) if not isinstance(r, Exception))
    assert winner is not None
    assert (await profiles.badges.find_one({"_id": badge.id}))["label"] == winner.label
    assert [e[0] for e in await published(writer)] == ["issued", "relabelled"]
    profile = Profile(name="ada")  # without revision: expected_version is the guard
    await writer.insert(profile, [Event(type="joined")])
    stale = await Profile.get(profile.id)
    assert stale is not None
    profile.name = "bob"
    await writer.save_changes(profile, [Event(type="renamed")], expected_version=1)
    stale.name = "eve"
    with pytest.raises(ConcurrencyError):
        await writer.save_changes(stale, [Event(type="renamed")], expected_version=stale.version)
    assert (await profiles.profiles.find_one({"_id": profile.id}))["name"] == "bob"


async def test_save_changes_without_state_management_is_refused(profiles: Any) -> None:
    writer = writer_of(profiles, "collection")
    with pytest.raises(ConfigurationError, match="use_state_management") as refused:
        await writer.save_changes(Stock(sku="pen", qty=1), [Event(type="stocked")])
    assert refused.value.setting == "Stock.Settings.use_state_management"
    assert await profiles.stock.count_documents({}) == 0
    assert await profiles.outbox.count_documents({}) == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_replace_keeps_the_outbox_counters_and_pending_events(
    profiles: Any, mode: str
) -> None:
    writer = writer_of(profiles, mode)
    profile = Profile(name="ada")
    await writer.insert(profile, [Event(type="joined")])
    profile.city = "rome"
    await writer.save(profile, [Event(type="moved")])
    await profiles.profiles.update_one({"_id": profile.id}, {"$set": {"stray": 1}})
    profile.name = "bob"
    saved = await writer.replace(profile, [Event(type="renamed")])
    # Beanie's own replace() wrote the model's fields alone: the counters started again and, in
    # embedded mode, the pending events went with it.
    assert (saved.version, saved.events[0].sequence, profile.version) == (3, 3, 3)
    stored = await profiles.profiles.find_one({"_id": profile.id})
    assert "stray" not in stored and (stored["name"], stored["city"]) == ("bob", "rome")
    assert (stored["_version"], stored["_sequence"]) == (3, 3)
    if mode == "embedded":
        assert [e["type"] for e in stored["_outbox"]] == ["joined", "moved", "renamed"]
    aggregate = str(profile.id)
    assert await published(writer) == [
        ("joined", aggregate, 1),
        ("moved", aggregate, 2),
        ("renamed", aggregate, 3),
    ]
    assert (await writer.save(profile, [Event(type="moved")])).events[0].sequence == 4


@pytest.mark.parametrize("mode", MODES)
async def test_two_replaces_of_one_document_at_once(profiles: Any, mode: str) -> None:
    writer = writer_of(profiles, mode)
    profile = Profile(name="ada")
    await writer.insert(profile, [Event(type="joined")])
    copies = [await Profile.get(profile.id) for _ in range(2)]
    for copy_, name in zip(copies, ["bob", "eve"], strict=True):
        assert copy_ is not None
        copy_.name = name
    unguarded = await asyncio.gather(
        *(writer.replace(c, [Event(type="renamed")]) for c in copies if c is not None)
    )
    # Unguarded, as Beanie's replace: both stand, one after the other, each event numbered.
    assert sorted(s.version for s in unguarded) == [2, 3]
    assert [e[2] for e in await published(writer)] == [1, 2, 3]
    badge = Badge(label="new")
    await writer.insert(badge, [Event(type="issued")])
    badges = [await Badge.get(badge.id) for _ in range(2)]
    for copy_, label in zip(badges, ["gold", "silver"], strict=True):
        assert copy_ is not None
        copy_.label = label
    guarded = await asyncio.gather(
        *(writer.replace(c, [Event(type="relabelled")]) for c in badges if c is not None),
        return_exceptions=True,
    )
    assert sorted(type(r).__name__ for r in guarded) == ["RevisionConflictError", "Saved"]
    assert (await profiles.badges.find_one({"_id": badge.id}))["_version"] == 2


async def test_a_replace_of_a_document_not_stored_writes_nothing(profiles: Any) -> None:
    writer = writer_of(profiles, "collection")
    with pytest.raises(AggregateNotFoundError):
        await writer.replace(Profile(id=ObjectId(), name="ada"), [Event(type="renamed")])
    with pytest.raises(InvalidAggregateError):
        await writer.replace(Profile(name="ada"), [Event(type="renamed")])
    assert await profiles.profiles.count_documents({}) == 0
    assert await profiles.outbox.count_documents({}) == 0


@pytest.mark.parametrize("mode", MODES)
async def test_insert_many_writes_every_document_with_its_events_or_none(
    profiles: Any, mongo: MongoServer, mode: str
) -> None:
    writer = writer_of(profiles, mode)
    ada, bob = Profile(name="ada"), Profile(name="bob")
    saved = await writer.insert_many([(ada, [Event(type="joined")]), (bob, [Event(type="joined")])])
    assert [s.id for s in saved] == [ada.id, bob.id] and (ada.version, bob.version) == (1, 1)
    assert sorted(await published(writer)) == sorted(
        [("joined", str(ada.id), 1), ("joined", str(bob.id), 1)]
    )
    # The second document's _id is stored: the first is not written either.
    eve, twin = Profile(name="eve"), Profile(id=ada.id, name="twin")
    with pytest.raises(ConcurrencyError):
        await writer.insert_many([(eve, [Event(type="joined")]), (twin, [Event(type="joined")])])
    assert eve.id is None and eve.version == 0  # as before the call
    with pytest.raises(InvalidAggregateError, match="twice"):
        await writer.insert_many([(eve, [Event(type="joined")]), (eve, [Event(type="joined")])])
    # A document whose collection the outbox refuses (embedded mode scans profiles and badges
    # only; in collection mode another client's), after one it takes.
    other_client: AsyncMongoClient[Any] = AsyncMongoClient(mongo.uri, uuidRepresentation="standard")
    try:
        if mode == "collection":
            await init_beanie(database=other_client[profiles.name], document_models=[Stock])
        with pytest.raises(InvalidAggregateError):
            await writer.insert_many(
                [(eve, [Event(type="joined")]), (Stock(sku="pen", qty=1), [Event(type="in")])]
            )
    finally:
        await other_client.close()
    assert await profiles.profiles.count_documents({}) == 2
    assert await profiles.stock.count_documents({}) == 0
    assert len(await published(writer)) == 0  # nothing new since the drain
    with pytest.raises(UsageError, match="pairs"):
        await writer.insert_many([eve])


async def test_a_refused_insert_many_in_the_callers_transaction_aborts_it(profiles: Any) -> None:
    writer = writer_of(profiles, "collection")
    ada = Profile(name="ada")
    await writer.insert(ada, [Event(type="joined")])
    eve, twin = Profile(name="eve"), Profile(id=ada.id, name="twin")
    async with profiles.client.start_session() as session:
        await session.start_transaction()
        await writer.insert(Profile(name="bob"), [Event(type="joined")], session=session)
        with pytest.raises(ConcurrencyError):
            await writer.insert_many(
                [(eve, [Event(type="joined")]), (twin, [Event(type="joined")])], session=session
            )
        # Committed, it would have stored eve without the rest of its batch.
        assert not session.in_transaction
    assert await profiles.profiles.count_documents({}) == 1
    assert await profiles.outbox.count_documents({}) == 1


async def test_a_bulk_writer_is_refused_before_anything_is_written(profiles: Any) -> None:
    writer = writer_of(profiles, "collection")
    profile = Profile(name="ada")
    async with BulkWriter() as bulk:
        for call in (
            writer.insert(profile, [Event(type="joined")], bulk_writer=bulk),
            writer.save(profile, [Event(type="joined")], bulk_writer=bulk),
            writer.insert_many([(profile, [Event(type="joined")])], bulk_writer=bulk),
        ):
            with pytest.raises(UsageError, match="BulkWriter"):
                await call
    assert await profiles.profiles.count_documents({}) == 0
    assert await profiles.outbox.count_documents({}) == 0


class Owner(Document):
    name: str

    class Settings:
        name = "owners"


class Pet(Document):
    name: str
    owner: Link[Owner]
    friends: list[Link[Owner]] = Field(default_factory=list)

    class Settings:
        name = "pets"


@pytest.mark.parametrize("mode", MODES)
async def test_link_rule_write_saves_the_linked_documents_in_the_same_transaction(
    models: Any, mode: str
) -> None:
    await init_beanie(database=models, document_models=[Owner, Pet])
    writer = BeanieOutbox(Outbox(models, mode=mode, collections=["pets"]))  # type: ignore[arg-type]
    owner, friend = Owner(name="ada"), Owner(name="bob")
    pet = Pet(name="rex", owner=owner, friends=[friend])
    await writer.insert(pet, [Event(type="adopted")], link_rule=WriteRules.WRITE)
    assert {o["name"] async for o in models.owners.find()} == {"ada", "bob"}
    stored = await models.pets.find_one({"_id": pet.id})
    assert stored["owner"].id == owner.id and stored["_version"] == 1
    # The pet's write refused (its _id is stored): the new owner is not stored either.
    newcomer = Owner(name="eve")
    twin = Pet(id=pet.id, name="rex", owner=newcomer)
    with pytest.raises(ConcurrencyError):
        await writer.insert(twin, [Event(type="adopted")], link_rule=WriteRules.WRITE)
    assert await models.owners.count_documents({"name": "eve"}) == 0
    owner.name = "ada l."
    pet.name = "rex ii"
    await writer.replace(pet, [Event(type="renamed")], link_rule=WriteRules.WRITE)
    assert (await models.owners.find_one({"_id": owner.id}))["name"] == "ada l."
    assert (await models.pets.find_one({"_id": pet.id}))["_version"] == 2
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.outbox, publisher).drain() == 2


async def test_save_changes_without_keep_nulls_unsets_only_what_became_none(
    profiles: Any,
) -> None:
    writer = writer_of(profiles, "collection")
    contact = Contact(email="a@x")
    await writer.insert(contact, [Event(type="added")])
    other = await Contact.get(contact.id)
    assert other is not None
    other.phone = "123"
    await writer.save_changes(other, [Event(type="phoned")])
    contact.email = None  # its phone is None as loaded: Beanie's save_changes unset it too
    await writer.save_changes(contact, [Event(type="unmailed")])
    stored = await profiles.contacts.find_one({"_id": contact.id})
    assert "email" not in stored and stored["phone"] == "123" and stored["_version"] == 3


async def test_a_refused_write_with_links_aborts_the_callers_transaction(models: Any) -> None:
    await init_beanie(database=models, document_models=[Owner, Pet])
    writer = BeanieOutbox(Outbox(models))
    pet = Pet(name="rex", owner=Owner(name="ada"))
    await writer.insert(pet, [Event(type="adopted")], link_rule=WriteRules.WRITE)
    twin = Pet(id=pet.id, name="rex", owner=Owner(name="eve"))
    async with models.client.start_session() as session:
        await session.start_transaction()
        with pytest.raises(ConcurrencyError):
            await writer.insert(
                twin, [Event(type="adopted")], session=session, link_rule=WriteRules.WRITE
            )
        # Committed, it would have stored eve, linked from no pet.
        assert not session.in_transaction
    assert await models.owners.count_documents({"name": "eve"}) == 0


@pytest.mark.parametrize("mode", MODES)
async def test_two_insert_many_sharing_an_id_at_once_store_one_batch_whole(
    profiles: Any, mode: str
) -> None:
    writer = writer_of(profiles, mode)
    shared = ObjectId()
    batches = [
        [
            (Profile(id=shared, name=f"{side} 1"), [Event(type="joined")]),
            (Profile(name=f"{side} 2"), [Event(type="joined")]),
        ]
        for side in ("left", "right")
    ]
    results = await asyncio.gather(
        *(writer.insert_many(batch) for batch in batches), return_exceptions=True
    )
    assert sorted(type(r).__name__ for r in results) == ["ConcurrencyError", "list"]
    won = next(b for b, r in zip(batches, results, strict=True) if isinstance(r, list))
    assert sorted([d["name"] async for d in profiles.profiles.find()]) == [
        won[0][0].name,
        won[1][0].name,
    ]
    lost = next(b for b in batches if b is not won)
    assert lost[1][0].id is None  # its other document, not written, got no id either
    assert len(await published(writer)) == 2
