"""MongoEngine documents saved with their events through ``MongoEngineOutbox`` and the sync
outbox, on the real MongoEngine, in both modes: the document and its events in one write,
MongoEngine's validation, signals and save_condition kept, the outbox's fields loadable."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mongoengine as me
import pytest
from bson import ObjectId
from mongoengine import signals
from mongoengine.errors import InvalidDocumentError
from pydantic import BaseModel
from pymongo import monitoring

from mongo_outbox import (
    ConcurrencyError,
    DuplicateSequenceError,
    Event,
    Outbox,
    OutboxError,
    PollingRelay,
    UsageError,
)
from mongo_outbox.odm.mongoengine import MongoEngineOutbox, SaveConditionConflictError
from mongo_outbox.publishers import MemoryPublisher
from mongo_outbox.sync import Outbox as SyncOutbox
from tests.support.servers import MongoServer

MODES = ["collection", "embedded"]
SIGNALS: list[str] = []


class OrderPlaced(BaseModel):
    """An ODM-free payload: what consumers read back with payload_as."""

    total: int


class Order(me.Document):
    customer = me.StringField(required=True, min_length=1)
    total = me.IntField(min_value=0, required=True)
    lines = me.ListField(me.StringField())
    placed_by = me.StringField(db_field="placedBy")
    version = me.IntField(db_field="_version", default=0)
    meta = {"collection": "orders", "strict": False}  # noqa: RUF012

    def clean(self) -> None:
        self.customer = self.customer.strip()


class Ticket(me.Document):
    """A custom _id type."""

    id = me.UUIDField(primary_key=True, binary=True, default=uuid.uuid4)
    title = me.StringField()
    meta = {"collection": "tickets", "strict": False}  # noqa: RUF012


def record(name: str) -> Any:
    def receiver(sender: Any, document: Any, **kwargs: Any) -> None:
        created = kwargs.get("created")
        SIGNALS.append(name if created is None else f"{name} created={created}")

    return receiver


RECEIVERS = {
    signals.pre_save: record("pre_save"),
    signals.pre_save_post_validation: record("pre_save_post_validation"),
    signals.post_save: record("post_save"),
    signals.pre_delete: record("pre_delete"),
    signals.post_delete: record("post_delete"),
}


@pytest.fixture
def engine(db: Any, mongo: MongoServer) -> Iterator[Any]:
    """MongoEngine connected to the test's database; its classes forget the last one's."""
    me.connect(db=db.name, host=mongo.uri, tz_aware=True, uuidRepresentation="standard")
    for model in (Order, Ticket):
        model._collection = None
    for signal, receiver in RECEIVERS.items():
        signal.connect(receiver, sender=Order)
    SIGNALS.clear()
    yield me.get_db()
    for signal, receiver in RECEIVERS.items():
        signal.disconnect(receiver, sender=Order)
    me.disconnect()


def outbox_of(database: Any, mode: str) -> MongoEngineOutbox:
    outbox = SyncOutbox(database, mode=mode, collections=["orders", "tickets"])  # type: ignore[arg-type]
    return MongoEngineOutbox(outbox)


@pytest.mark.parametrize("mode", MODES)
async def test_a_saved_document_and_its_events_load_back_in_mongoengine(
    engine: Any, db: Any, mode: str
) -> None:
    orders = outbox_of(engine, mode)
    order = Order(customer=" ada ", total=10, placed_by="web")
    saved = orders.save(order, [Event.of(OrderPlaced(total=10), type="order.placed")])
    assert isinstance(order.id, ObjectId) and saved.id == order.id and saved.version == 1
    assert order.version == 1 and order.customer == "ada"  # clean() ran before the write
    stored = engine.orders.find_one({"_id": order.id})
    assert stored["placedBy"] == "web" and stored["_version"] == 1
    loaded = Order.objects.get(id=order.id)
    assert (loaded.total, loaded.version) == (10, 1)
    loaded.total = 12
    orders.save(loaded, [Event(type="order.repriced")], expected_version=1)
    loaded.lines = ["book"]
    loaded.save()  # MongoEngine's own save keeps the outbox's fields
    again = engine.orders.find_one({"_id": order.id})
    assert (again["_version"], again["total"], again["lines"]) == (2, 12, ["book"])
    if mode == "embedded":
        assert [e["type"] for e in again["_outbox"]] == ["order.placed", "order.repriced"]
    publisher = MemoryPublisher()
    relay_outbox = Outbox(db, mode=mode, collections=["orders", "tickets"])  # type: ignore[arg-type]
    assert await PollingRelay(relay_outbox, publisher).drain() == 2
    first = publisher.events[0]
    assert (first.aggregate_id, first.sequence) == (str(order.id), 1)  # an ObjectId as JSON
    assert first.payload_as(OrderPlaced) == OrderPlaced(total=10)


@pytest.mark.parametrize("mode", MODES)
def test_signals_fire_as_mongoengine_fires_them(engine: Any, mode: str) -> None:
    orders = outbox_of(engine, mode)
    order = Order(customer="ada", total=1)
    orders.save(order, [Event(type="order.placed")])
    order.total = 2
    orders.save(order, [Event(type="order.repriced")])
    assert SIGNALS == [
        "pre_save",
        "pre_save_post_validation created=True",
        "post_save created=True",
        "pre_save",
        "pre_save_post_validation created=False",
        "post_save created=False",
    ]


@pytest.mark.parametrize("mode", MODES)
def test_an_invalid_document_writes_nothing(engine: Any, mode: str) -> None:
    orders = outbox_of(engine, mode)
    with pytest.raises(me.ValidationError):
        orders.save(Order(customer="ada", total=-1), [Event(type="order.placed")])
    assert engine.orders.count_documents({}) == 0
    assert engine.outbox.count_documents({}) == 0


@pytest.mark.parametrize("mode", MODES)
def test_modify_with_django_style_keywords_reloads_the_document(engine: Any, mode: str) -> None:
    orders = outbox_of(engine, mode)
    order = Order(customer="ada", total=1)
    orders.save(order, [Event(type="order.placed")])
    saved = orders.modify(order, [Event(type="added")], push__lines="book", inc__total=4)
    assert saved.version == 2 and order.version == 2
    assert (order.lines, order.total) == (["book"], 5)
    with pytest.raises(SaveConditionConflictError):
        orders.modify(order, [Event(type="x")], query={"total": 1}, set__total=0)
    with pytest.raises(ConcurrencyError):
        orders.modify(order, [Event(type="x")], expected_version=1, set__total=0)
    assert Order.objects.get(id=order.id).total == 5


@pytest.mark.parametrize("mode", MODES)
def test_save_condition_and_expected_version_guard_a_save(engine: Any, mode: str) -> None:
    orders = outbox_of(engine, mode)
    order = Order(customer="ada", total=1)
    orders.save(order, [Event(type="order.placed")])
    stale = Order.objects.get(id=order.id)
    order.total = 2
    orders.save(order, [Event(type="order.repriced")], save_condition={"total": 1})
    stale.total = 3
    with pytest.raises(me.errors.SaveConditionError):  # MongoEngine's own error, too
        orders.save(stale, [Event(type="order.repriced")], save_condition={"total": 1})
    with pytest.raises(ConcurrencyError):
        orders.save(stale, [Event(type="order.repriced")], expected_version=stale.version)
    assert Order.objects.get(id=order.id).total == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_uuid_primary_key_is_the_aggregate_id(engine: Any, mode: str) -> None:
    tickets = outbox_of(engine, mode)
    ticket = Ticket(title="printer")
    saved = tickets.save(ticket, [Event(type="ticket.opened")])
    assert isinstance(saved.id, uuid.UUID) and saved.id == ticket.id
    assert saved.events[0].aggregate_id == str(ticket.id)
    assert Ticket.objects.get(id=ticket.id).title == "printer"


def test_delete_records_its_event_in_collection_mode(engine: Any) -> None:
    orders = outbox_of(engine, "collection")
    order = Order(customer="ada", total=1)
    orders.save(order, [Event(type="order.placed")])
    deleted = orders.delete(order, [Event(type="order.deleted")], expected_version=1)
    assert deleted.version == 2 and Order.objects(id=order.id).count() == 0
    assert engine.outbox.count_documents({"aggregate_id": str(order.id)}) == 2
    assert SIGNALS[-2:] == ["pre_delete", "post_delete"]


def test_a_save_joins_the_callers_transaction(engine: Any) -> None:
    orders = outbox_of(engine, "collection")
    with me.get_connection().start_session() as session:
        with session.start_transaction():
            orders.save(Order(customer="ada", total=1), [Event(type="x")], session=session)
            session.abort_transaction()
    assert engine.orders.count_documents({}) == 0
    assert engine.outbox.count_documents({}) == 0


@pytest.mark.parametrize("mode", MODES)
def test_an_unchanged_document_saved_with_events_writes_no_field(engine: Any, mode: str) -> None:
    orders = outbox_of(engine, mode)
    order = Order(customer="ada", total=1)
    orders.save(order, [Event(type="order.placed")])
    stale = Order.objects.get(id=order.id)
    fresh = Order.objects.get(id=order.id)
    fresh.total = 7
    orders.save(fresh, [Event(type="order.repriced")])
    # Nothing changed on `stale` (MongoEngine's own save would write nothing): its events go,
    # and the price another writer stored stays.
    saved = orders.save(stale, [Event(type="order.viewed")])
    assert saved.version == 3 and stale.version == 3
    assert engine.orders.find_one({"_id": order.id})["total"] == 7


def test_deleting_a_document_never_saved_is_refused_before_its_signals(engine: Any) -> None:
    orders = outbox_of(engine, "collection")
    with pytest.raises(InvalidDocumentError, match="primary key"):
        orders.delete(Order(customer="ada", total=1), [Event(type="order.deleted")])
    assert SIGNALS == [] and engine.outbox.count_documents({}) == 0


def test_a_save_in_an_aborted_transaction_is_made_again_by_the_next_save(engine: Any) -> None:
    orders = outbox_of(engine, "collection")
    order = Order(customer="ada", total=1)
    loaded = Order(customer="bob", total=1)
    orders.save(loaded, [Event(type="order.placed")])
    loaded = Order.objects.get(id=loaded.id)
    loaded.total = 5
    with me.get_connection().start_session() as session:
        with session.start_transaction():
            orders.save(order, [Event(type="order.placed")], session=session)
            orders.save(loaded, [Event(type="order.repriced")], session=session)
            session.abort_transaction()
    # The retry: the new document is created (it was taken for a stored one, and not found),
    # and the loaded one's change is sent again (it was taken for sent, and its event went out
    # alone, the price unchanged).
    assert orders.save(order, [Event(type="order.placed")]).version == 1
    assert orders.save(loaded, [Event(type="order.repriced")]).version == 2
    assert Order.objects.get(id=order.id).total == 1
    assert Order.objects.get(id=loaded.id).total == 5
    assert [e["type"] for e in engine.outbox.find({"aggregate_id": str(loaded.id)})] == [
        "order.placed",
        "order.repriced",
    ]


def test_mongoengines_own_save_of_a_new_object_with_a_stored_id_is_refused_at_the_next_save(
    engine: Any,
) -> None:
    orders = outbox_of(engine, "collection")
    order = Order(customer="ada", total=1)
    orders.save(order, [Event(type="order.placed")])
    # MongoEngine replaces the stored document, the outbox's counters with it.
    Order(id=order.id, customer="ada", total=2).save()
    again = Order.objects.get(id=order.id)
    again.total = 3
    with pytest.raises(DuplicateSequenceError, match="up to sequence 1"):
        orders.save(again, [Event(type="order.repriced")])
    assert Order.objects.get(id=order.id).total == 2
    assert engine.outbox.count_documents({}) == 1


@pytest.mark.parametrize("mode", MODES)
def test_guarded_writes_in_an_aborted_transaction_are_made_again_by_their_retry(
    engine: Any, mode: str
) -> None:
    orders = outbox_of(engine, mode)
    order, other = Order(customer="ada", total=1), Order(customer="bob", total=1)
    orders.save(order, [Event(type="order.placed")])
    orders.save(other, [Event(type="order.placed")])
    order = Order.objects.get(id=order.id)
    order.total = 5
    repriced, raised = Event(type="order.repriced"), Event(type="order.repriced")
    for attempt in ("aborted", "retried"):
        with me.get_connection().start_session() as session:
            with session.start_transaction():
                guards = order.version, other.version
                orders.save(order, [repriced], session=session, expected_version=guards[0])
                orders.modify(
                    other, [raised], session=session, expected_version=guards[1], inc__total=2
                )
                if attempt == "aborted":
                    session.abort_transaction()
    # The retry used to be refused (ConcurrencyError): the aborted writes had given the
    # documents the version they wrote, which the stored ones never got.
    assert [(o.total, o.version) for o in Order.objects.order_by("customer")] == [(5, 2), (3, 2)]
    assert engine.outbox.count_documents({}) == (4 if mode == "collection" else 0)
    # Until the commit is known, the documents keep their versions: load them again after it.
    assert (order.version, other.version) == (1, 1)


@pytest.mark.parametrize("mode", MODES)
def test_force_insert_of_a_stored_id_is_refused_with_no_event(engine: Any, mode: str) -> None:
    orders = outbox_of(engine, mode)
    order = Order(customer="ada", total=1)
    orders.save(order, [Event(type="order.placed")], force_insert=True)
    twin = Order(id=order.id, customer="bob", total=9)
    with pytest.raises(ConcurrencyError):
        orders.save(twin, [Event(type="order.placed")], force_insert=True)
    loaded = Order.objects.get(id=order.id)
    with pytest.raises(ConcurrencyError):  # a loaded one too: an insert, as MongoEngine's
        orders.save(loaded, [Event(type="order.placed")], force_insert=True)
    # Without force_insert a new object's save is a replace, which took the first one over.
    stored = engine.orders.find_one({"_id": order.id})
    assert (stored["customer"], stored["_version"], stored["_sequence"]) == ("ada", 1, 1)
    if mode == "collection":
        assert [e["type"] for e in engine.outbox.find()] == ["order.placed"]
    else:
        assert [e["type"] for e in stored["_outbox"]] == ["order.placed"]
    assert twin.id == order.id and twin._created  # refused: still a new document
    with pytest.raises(UsageError, match="force_insert"):
        orders.save(twin, [Event(type="x")], force_insert=True, expected_version=1)


def test_two_force_inserts_of_one_id_at_once_store_one(engine: Any) -> None:
    orders = outbox_of(engine, "collection")
    shared = ObjectId()
    twins = [Order(id=shared, customer=name, total=1) for name in ("ada", "bob")]
    with ThreadPoolExecutor(2) as pool:
        results = list(
            pool.map(
                lambda o: _outcome(
                    lambda: orders.save(o, [Event(type="order.placed")], force_insert=True)
                ),
                twins,
            )
        )
    assert sorted(results) == ["ConcurrencyError", "Saved"]
    assert engine.orders.count_documents({}) == 1 and engine.outbox.count_documents({}) == 1


def _outcome(call: Any) -> str:
    try:
        return type(call()).__name__
    except OutboxError as error:
        return type(error).__name__


class Commands(monitoring.CommandListener):
    """The write concern of each command the client sends."""

    def __init__(self) -> None:
        self.concerns: dict[str, list[Any]] = {}

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        concern = event.command.get("writeConcern")
        self.concerns.setdefault(event.command_name, []).append(concern)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.mark.parametrize("mode", MODES)
def test_write_concern_reaches_the_server(engine: Any, mongo: MongoServer, mode: str) -> None:
    commands = Commands()
    me.disconnect()
    me.connect(
        db=engine.name,
        host=mongo.uri,
        tz_aware=True,
        uuidRepresentation="standard",
        event_listeners=[commands],
    )
    Order._collection = None
    database = me.get_db()
    orders = outbox_of(database, mode)
    order = Order(customer="ada", total=1)
    orders.save(order, [Event(type="order.placed")], write_concern={"w": 1, "wtimeout": 4321})
    order.total = 2
    orders.save(order, [Event(type="order.repriced")], write_concern={"w": 1, "wtimeout": 4321})
    wanted = {"w": 1, "wtimeout": 4321}
    if mode == "collection":  # the save's own transaction commits with it
        assert commands.concerns["commitTransaction"] == [wanted, wanted]
    else:  # the document's one write carries it
        sent = commands.concerns.get("insert", []) + commands.concerns.get("findAndModify", [])
        assert wanted in sent
    order.total = 3
    commands.concerns.clear()
    orders.save(order, [Event(type="order.repriced")])  # the client's default, as before
    assert all(wanted not in sent for sent in commands.concerns.values())
    assert database.orders.find_one({"_id": order.id})["_version"] == 3
    with me.get_connection().start_session() as session, pytest.raises(UsageError):
        orders.save(order, [Event(type="x")], session=session, write_concern={"w": 1})
    with pytest.raises(UsageError, match="unacknowledged"):
        orders.save(order, [Event(type="x")], write_concern={"w": 0})
    assert database.orders.find_one({"_id": order.id})["_version"] == 3
