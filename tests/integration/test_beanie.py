"""Beanie documents saved with their events through ``BeanieOutbox``, on the real Beanie, in both
modes: the document and its events in one write, Beanie's validation, actions and revision_id
kept, the outbox's fields invisible to the model, typed payloads read back."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from beanie import (
    Document,
    Insert,
    Save,
    Update,
    after_event,
    before_event,
    init_beanie,
)
from beanie.exceptions import RevisionIdWasChanged
from beanie.odm.operators.update.array import Push
from bson import ObjectId
from pydantic import BaseModel, Field, ValidationError
from pymongo import AsyncMongoClient

from mongo_outbox import ConcurrencyError, Event, Outbox, PollingRelay, UsageError
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
