"""ODMantic instances saved with their events through ``ODManticOutbox``, on the real ODMantic
(and Motor, its driver), in both modes: the instance and its events in one write, ODMantic's
loading unbroken by the outbox's fields, a transaction of ODMantic's joined."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from odmantic import AIOEngine, Field, Model
from pydantic import BaseModel

from mongo_outbox import AggregateNotFoundError, ConcurrencyError, Event, Outbox, PollingRelay
from mongo_outbox.odm.odmantic import ODManticOutbox
from mongo_outbox.publishers import MemoryPublisher
from tests.support.servers import MongoServer

MODES = ["collection", "embedded"]


class OrderPlaced(BaseModel):
    total: int


class Order(Model):
    customer: str
    total: int = Field(ge=0)
    lines: list[str] = Field(default_factory=list)
    model_config = {"collection": "orders"}  # noqa: RUF012 - ODMantic reads it so


class Sku(Model):
    """A custom primary key."""

    code: str = Field(primary_field=True)
    stock: int
    model_config = {"collection": "skus"}  # noqa: RUF012


class Account(Model):
    """The outbox's version as a field."""

    balance: int
    version: int = Field(default=0, key_name="_version")
    model_config = {"collection": "accounts"}  # noqa: RUF012


@pytest.fixture
async def engine(mongo: MongoServer) -> AsyncIterator[AIOEngine]:
    from motor.motor_asyncio import AsyncIOMotorClient

    client: Any = AsyncIOMotorClient(mongo.uri, tz_aware=True)
    name = f"odmantic_{uuid.uuid4().hex[:10]}"
    yield AIOEngine(client=client, database=name)
    await client.drop_database(name)
    client.close()


def outbox_of(engine: AIOEngine, mode: str) -> ODManticOutbox:
    outbox = Outbox(engine.database, mode=mode, collections=["orders", "skus", "accounts"])  # type: ignore[arg-type]
    return ODManticOutbox(engine, outbox)


@pytest.mark.parametrize("mode", MODES)
async def test_a_saved_instance_and_its_events_load_back_in_odmantic(
    engine: AIOEngine, mode: str
) -> None:
    orders = outbox_of(engine, mode)
    order = Order(customer="ada", total=10)
    saved = await orders.save(order, [Event.of(OrderPlaced(total=10), type="order.placed")])
    assert saved.id == order.id and saved.version == 1
    loaded = await engine.find_one(Order, Order.id == order.id)
    assert loaded is not None and loaded.total == 10
    loaded.total = 12
    await orders.save(loaded, [Event(type="order.repriced")], expected_version=1)
    with pytest.raises(ConcurrencyError):
        await orders.save(loaded, [Event(type="order.repriced")], expected_version=1)
    loaded.lines.append("book")
    await engine.save(loaded)  # ODMantic's own save keeps the outbox's fields
    stored = await engine.database.orders.find_one({"_id": order.id})
    assert (stored["_version"], stored["total"], stored["lines"]) == (2, 12, ["book"])
    if mode == "embedded":
        assert [e["type"] for e in stored["_outbox"]] == ["order.placed", "order.repriced"]
    publisher = MemoryPublisher()
    assert await PollingRelay(orders.outbox, publisher).drain() == 2
    assert publisher.events[0].payload_as(OrderPlaced) == OrderPlaced(total=10)
    assert publisher.events[1].sequence == 2


@pytest.mark.parametrize("mode", MODES)
async def test_a_custom_primary_key_is_the_aggregate_id(engine: AIOEngine, mode: str) -> None:
    skus = outbox_of(engine, mode)
    saved = await skus.save(Sku(code="book", stock=3), [Event(type="sku.added")])
    assert saved.id == "book" and saved.events[0].aggregate_id == "book"
    assert (await engine.find_one(Sku, Sku.code == "book")).stock == 3  # type: ignore[union-attr]


async def test_a_save_joins_an_odmantic_transaction_and_delete_records_its_event(
    engine: AIOEngine,
) -> None:
    orders = outbox_of(engine, "collection")
    order = Order(customer="ada", total=1)
    async with engine.transaction() as transaction:
        await orders.save(order, [Event(type="order.placed")], session=transaction)
        await transaction.abort()
    assert await engine.count(Order) == 0 and await engine.database.outbox.count_documents({}) == 0
    await orders.save(order, [Event(type="order.placed")])
    deleted = await orders.delete(order, [Event(type="order.deleted")], expected_version=1)
    assert deleted.version == 2 and await engine.count(Order) == 0


@pytest.mark.parametrize("mode", MODES)
async def test_an_unchanged_instance_saved_with_events_writes_no_field(
    engine: AIOEngine, mode: str
) -> None:
    skus = outbox_of(engine, mode)
    sku = Sku(code="pen", stock=3)
    await skus.save(sku, [Event(type="stocked")])
    stale = await engine.find_one(Sku, Sku.code == "pen")
    fresh = await engine.find_one(Sku, Sku.code == "pen")
    assert stale is not None and fresh is not None
    fresh.stock = 1
    await skus.save(fresh, [Event(type="taken")])
    # Nothing to send from `stale` (ODMantic's own save writes nothing): its events go, and
    # the stock another writer stored stays.
    assert (await skus.save(stale, [Event(type="viewed")])).version == 3
    assert (await engine.database.skus.find_one({"_id": "pen"}))["stock"] == 1
    if mode == "collection":
        await skus.delete(fresh, [Event(type="discontinued")])
        with pytest.raises(AggregateNotFoundError):  # not created again, empty
            await skus.save(stale, [Event(type="viewed")])
        assert await engine.database.skus.count_documents({}) == 0


async def test_a_loaded_instance_deleted_meanwhile_is_not_created_again(
    engine: AIOEngine,
) -> None:
    orders = outbox_of(engine, "collection")
    order = Order(customer="ada", total=1)
    await orders.save(order, [Event(type="placed")])
    stale = await engine.find_one(Order, Order.id == order.id)
    assert stale is not None
    await orders.delete(order, [Event(type="deleted")])
    # Unchanged, it still sends its mutable field (lines): that made an upsert, which created
    # {"lines": []} alone, its events starting again at sequence 1.
    with pytest.raises(AggregateNotFoundError):
        await orders.save(stale, [Event(type="viewed")])
    stale.total = 2
    with pytest.raises(AggregateNotFoundError):
        await orders.save(stale, [Event(type="repriced")])
    assert await engine.database.orders.count_documents({}) == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_version_field_follows_the_saves_and_odmantics_own_save_never_sends_it(
    engine: AIOEngine, mode: str
) -> None:
    accounts = outbox_of(engine, mode)
    account = Account(balance=10)
    assert (await accounts.save(account, [Event(type="opened")])).version == 1
    assert account.version == 1  # it stayed 0: a save guarded by it was refused
    account.balance = 5
    await accounts.save(account, [Event(type="withdrawn")], expected_version=account.version)
    assert account.version == 2
    stale = await engine.find_one(Account, Account.id == account.id)
    assert stale is not None and stale.version == 2
    account.balance = 4
    await accounts.save(account, [Event(type="withdrawn")], expected_version=2)
    with pytest.raises(ConcurrencyError):
        await accounts.save(stale, [Event(type="withdrawn")], expected_version=stale.version)
    # Set by the save, not modified: ODMantic's own save of it sends no _version back.
    account.balance = 3
    await engine.save(account)
    stored = await engine.database.accounts.find_one({"_id": account.id})
    assert (stored["_version"], stored["balance"]) == (3, 3)


@pytest.mark.parametrize("mode", MODES)
async def test_a_guarded_save_in_an_aborted_transaction_is_made_again_by_its_retry(
    engine: AIOEngine, mode: str
) -> None:
    accounts = outbox_of(engine, mode)
    account = Account(balance=10)
    await accounts.save(account, [Event(type="opened")])
    account.balance = 5
    withdrawn = Event(type="withdrawn")
    for attempt in ("aborted", "retried"):
        async with engine.transaction() as transaction:
            guard = account.version
            await accounts.save(account, [withdrawn], session=transaction, expected_version=guard)
            if attempt == "aborted":
                await transaction.abort()
    # The retry used to be refused (ConcurrencyError): the aborted save had given the instance
    # the version it wrote, which the stored one never got.
    stored = await engine.database.accounts.find_one({"_id": account.id})
    assert (stored["_version"], stored["balance"]) == (2, 5)
    publisher = MemoryPublisher()
    assert await PollingRelay(accounts.outbox, publisher).drain() == 2
    assert [e.id for e in publisher.events][1:] == [withdrawn.id]
    # Until the commit is known, the instance keeps its version: load it again after it.
    assert account.version == 1
