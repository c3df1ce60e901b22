"""The rules every write with events obeys (``_write/rules.py``, ``_write/aggregates.py``),
checked before anything is written: a refusal raises while the plan is made, so no call reaches
a database. The collections are a real client's that never connects (``tests/unit/conftest.py``):
a rule that sent a command would fail these tests by a server selection timeout."""

from __future__ import annotations

import math
import re
import types
import uuid
from typing import Any

import pytest
from bson import ObjectId
from bson.binary import UuidRepresentation
from bson.codec_options import CodecOptions
from pydantic import model_validator
from pymongo import MongoClient, WriteConcern

from mongo_outbox import Event
from mongo_outbox._write.aggregates import aggregate_id, type_map
from mongo_outbox._write.rules import Rules
from mongo_outbox.errors import (
    ConfigurationError,
    InvalidAggregateError,
    InvalidEventError,
    UsageError,
)
from mongo_outbox.sync import Outbox
from tests.support.layouts import embedded, layout

OWNED = frozenset({"_version", "_sequence", "_outbox", "_due"})


def rules(db: Any, mode: str = "collection", types: dict[str, str] | None = None) -> Rules:
    return Rules(db, layout(db, mode), types or {}, OWNED)


class Session:
    """FAKE session: the rules read only these four attributes."""

    def __init__(self, client: Any, in_transaction: bool = True, has_ended: bool = False) -> None:
        self.client = client
        self.in_transaction = in_transaction
        self.has_ended = has_ended


def test_a_save_stamps_its_events_with_the_aggregate_and_leaves_out_the_fields_the_outbox_owns(
    shop: Any,
) -> None:
    event = Event(type="placed")
    document = {"_id": 7, "total": 3, "_version": 99, "_outbox": []}
    plan = rules(shop, types={"orders": "Order"}).save(None, shop.orders, document, [event], None)
    assert plan.body == {"_id": 7, "total": 3}
    assert plan.stamp == {"aggregate_type": "Order", "aggregate_id": 7}
    assert [e.id for e in plan.events] == [event.id]
    assert plan.entries[0]["_id"] == event.id
    assert plan.entries[0]["aggregate_type"] == "Order"
    assert plan.given == (event,)


def test_a_save_gives_a_document_without_id_one_only_when_it_is_not_refused(shop: Any) -> None:
    document: dict[str, Any] = {"total": 3}
    with pytest.raises(InvalidEventError):
        rules(shop).save(None, shop.orders, document, ["not an event"], None)  # type: ignore[list-item]
    with pytest.raises(InvalidAggregateError):
        rules(shop).save(None, shop.orders, document | {"bad": {1, 2}}, [Event(type="p")], None)
    assert document == {"total": 3}  # as the caller had it
    plan = rules(shop).save(None, shop.orders, document, [Event(type="placed")], None)
    assert isinstance(document["_id"], ObjectId)  # as insert_one does
    assert plan.body == {"_id": document["_id"], "total": 3} and plan.doc_id == document["_id"]


def test_an_embedded_entry_keeps_its_id_under_id_because_the_array_has_no_underscore_id(
    shop: Any,
) -> None:
    event = Event(type="placed")
    plan = rules(shop, "embedded").save(None, shop.orders, {"_id": "o1"}, [event], None)
    assert plan.entries[0]["id"] == event.id and "_id" not in plan.entries[0]


def test_a_document_without_an_id_gets_an_object_id_as_insert_one_gives_it(shop: Any) -> None:
    document: dict[str, Any] = {"total": 1}
    plan = rules(shop).save(None, shop.orders, document, [], None)
    assert isinstance(document["_id"], ObjectId) and plan.doc_id == document["_id"]
    assert plan.stamp["aggregate_id"] == str(document["_id"])


def test_a_read_only_document_without_an_id_is_refused_as_it_cannot_take_one(shop: Any) -> None:
    with pytest.raises(InvalidAggregateError, match="cannot take the one a save gives it"):
        rules(shop).save(None, shop.orders, types.MappingProxyType({"x": 1}), [], None)


def test_a_document_without_an_id_cannot_expect_a_version(shop: Any) -> None:
    with pytest.raises(InvalidAggregateError, match="without _id cannot match expected_version"):
        rules(shop).save(None, shop.orders, {"x": 1}, [], 2)


@pytest.mark.parametrize("version", [True, -1, 2**63, 1.0, "1"])
def test_an_expected_version_that_is_no_64_bit_count_is_refused(shop: Any, version: Any) -> None:
    with pytest.raises(InvalidAggregateError, match="expected_version must be an int"):
        rules(shop).save(None, shop.orders, {"_id": 1}, [], version)


def test_a_collection_of_another_client_is_refused_since_the_relay_would_never_see_it(
    shop: Any,
) -> None:
    other: MongoClient[Any] = MongoClient("mongodb://127.0.0.1:9", connect=False)
    try:
        with pytest.raises(InvalidAggregateError, match="not a collection of the outbox's client"):
            rules(shop).save(None, other.shop.orders, {"_id": 1}, [], None)
    finally:
        other.close()


def test_a_namesake_database_of_the_same_client_is_refused(shop: Any) -> None:
    with pytest.raises(InvalidAggregateError, match="not a collection of the outbox's client"):
        rules(shop).save(None, shop.client.other.orders, {"_id": 1}, [], None)


def test_embedded_mode_refuses_a_collection_it_does_not_scan(shop: Any) -> None:
    with pytest.raises(InvalidAggregateError, match="not in this outbox's collections"):
        rules(shop, "embedded").save(None, shop.invoices, {"_id": 1}, [], None)


def test_embedded_mode_refuses_unacknowledged_writes_outside_a_transaction(shop: Any) -> None:
    unacknowledged = shop.orders.with_options(write_concern=WriteConcern(w=0))
    with pytest.raises(InvalidAggregateError, match="unacknowledged"):
        rules(shop, "embedded").save(None, unacknowledged, {"_id": 1}, [], None)
    # In a transaction the transaction's write concern counts, not the collection's.
    session = Session(shop.client)
    rules(shop, "embedded").save(session, unacknowledged, {"_id": 1}, [], None)


def test_a_session_of_another_client_or_one_that_ended_is_refused(shop: Any) -> None:
    with pytest.raises(InvalidAggregateError, match="session belongs to another client"):
        rules(shop).save(Session(object()), shop.orders, {"_id": 1}, [], None)
    with pytest.raises(UsageError, match="the session has ended"):
        rules(shop).save(Session(shop.client, has_ended=True), shop.orders, {"_id": 1}, [], None)


def test_a_collection_or_session_of_the_wrong_kind_is_refused(shop: Any) -> None:
    with pytest.raises(InvalidAggregateError, match=r"must be a collection.*not a str"):
        rules(shop).save(None, "orders", {"_id": 1}, [], None)
    with pytest.raises(InvalidAggregateError, match="not a NoneType"):
        rules(shop).save(None, None, {"_id": 1}, [], None)
    with pytest.raises(UsageError, match=r"session must be a session.*not a str"):
        rules(shop).save("s", shop.orders, {"_id": 1}, [], None)


@pytest.mark.parametrize(
    "name",
    [
        "outbox",
        "outbox_config",
        "outbox_event_ids",
        "outbox_relays",
        "outbox_relay_members",
        "system.views",
        "system.js",
    ],
)
@pytest.mark.parametrize("mode", ["collection", "embedded"])
def test_the_outboxs_own_collections_and_mongodbs_take_no_aggregates(
    shop: Any, name: str, mode: str
) -> None:
    # Written there, an aggregate would overwrite the partition record (every writer then
    # refuses), stand in the outbox as an entry, take an event id in the registry, or overwrite
    # a relay's lease and checkpoint or a group's member record.
    outbox = Outbox(shop, mode=mode, collections=["orders"] if mode == "embedded" else ())
    with pytest.raises(InvalidAggregateError, match=rf"{name} is one of .* own collections"):
        outbox.save_with_events(None, shop[name], {"_id": "partitions", "count": 2}, [])
    with pytest.raises(InvalidAggregateError, match="own collections"):
        outbox.update_with_events(None, shop[name], {"_id": 1}, {"$set": {"a": 1}}, [])


@pytest.mark.parametrize(
    ("collections", "problem"),
    [
        ("orders", "a list of collection names, not the str 'orders'"),
        (["outbox_event_ids"], "outbox_event_ids is one of the outbox's own collections"),
        (["orders", "outbox"], "outbox is one of the outbox's own collections"),
        (["system.views"], "system.views is one of MongoDB's own collections"),
        (["outbox_relays"], "outbox_relays is one of the relays' own collections"),
        ([""], "must be a non-empty str"),
        ([None], "must be a non-empty str, not None"),
    ],
)
def test_embedded_collections_that_cannot_hold_aggregates_are_refused_at_once(
    shop: Any, collections: Any, problem: str
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(problem)) as refused:
        Outbox(shop, mode="embedded", collections=collections)
    assert refused.value.setting == "Outbox.collections"


@pytest.mark.parametrize(
    "made",
    [
        lambda e: e.model_copy(update={"payload": {"a": math.nan}}),
        lambda e: e.model_copy(update={"id": 5}),
        lambda e: e.model_copy(update={"id": {"$gt": ""}}),
        lambda e: e.model_copy(update={"type": ""}),
        lambda e: e.model_copy(update={"headers": {"k": 1}}),
        lambda e: Event.model_construct(type="y", payload="not a dict"),
    ],
    ids=["nan", "int_id", "dict_id", "empty_type", "int_header", "constructed"],
)
@pytest.mark.parametrize("mode", ["collection", "embedded"])
def test_an_event_made_without_validation_is_refused_as_its_constructor_would(
    shop: Any, made: Any, mode: str
) -> None:
    # model_copy(update=...) and model_construct skip pydantic's validation; stored, such an
    # event could never be read back to be published: the relay would park it.
    event = made(Event(type="placed"))
    with pytest.raises(InvalidEventError, match="made without validation"):
        rules(shop, mode).save(None, shop.orders, {"_id": 1}, [Event(type="ok"), event], None)


class Placed(Event):
    """An Event subclass whose constructor takes input of its own shape."""

    @model_validator(mode="before")
    @classmethod
    def _from_order(cls, data: Any) -> Any:
        data = dict(data)
        order = data.pop("order")
        return data | {"type": "order.placed", "payload": {"order": order}}


def test_a_subclass_built_by_its_own_validators_is_checked_as_the_event_it_is(shop: Any) -> None:
    # Checked again as an Event (what the relay reads), not through the subclass's validators,
    # which expect the subclass's own input.
    event = Placed(order="A-1")
    for made in (event, event.model_copy(), event.model_copy(update={"payload": {"order": "B"}})):
        plan = rules(shop).save(None, shop.orders, {"_id": 1}, [made], None)
        assert plan.events[0].type == "order.placed"


def test_events_given_as_anything_but_a_list_of_events_are_refused(shop: Any) -> None:
    with pytest.raises(InvalidEventError, match="must be a list of Event"):
        rules(shop).save(None, shop.orders, {"_id": 1}, "placed", None)  # type: ignore[arg-type]
    with pytest.raises(InvalidEventError, match="expected an Event, got dict"):
        rules(shop).save(None, shop.orders, {"_id": 1}, [{"type": "x"}], None)  # type: ignore[list-item]


def test_one_event_given_twice_in_a_write_is_refused(shop: Any) -> None:
    event = Event(type="placed")
    with pytest.raises(InvalidEventError, match="appears twice"):
        rules(shop).save(None, shop.orders, {"_id": 1}, [event, event], None)


def test_an_event_stamped_for_another_aggregate_is_refused(shop: Any) -> None:
    event = Event(type="placed", aggregate_id=2)
    with pytest.raises(InvalidEventError, match="publishes as 1"):
        rules(shop).save(None, shop.orders, {"_id": 1}, [event], None)


@pytest.mark.parametrize(
    ("doc_id", "why"),
    [
        # Fixed values: every worker of `pytest -n` must collect the same test ids.
        (str(ObjectId("6b0bbae40ac062a529543b07")), "spelled like an ObjectId"),
        (
            str(uuid.UUID("1638ac26-6010-48a5-bb14-a8a69376c18f")),
            "spelled like an ObjectId or UUID",
        ),
        (2**63, "does not fit in a 64-bit integer"),
        (1.5, "type float is not supported"),
    ],
)
def test_an_id_whose_events_could_not_name_their_aggregate_alone_is_refused(
    doc_id: Any, why: str
) -> None:
    with pytest.raises(InvalidAggregateError, match=why):
        aggregate_id(doc_id, "orders")


def test_two_collections_cannot_publish_as_one_aggregate_type() -> None:
    with pytest.raises(ConfigurationError, match="orders and carts would both publish as 'Order'"):
        type_map({"orders": "Order", "carts": "Order"}, ["orders", "carts"])


def test_a_document_that_mongodb_could_not_store_is_refused_before_the_write(shop: Any) -> None:
    with pytest.raises(InvalidAggregateError, match=r"key '\$x' cannot be stored"):
        rules(shop).save(None, shop.orders, {"_id": 1, "a": {"$x": 1}}, [], None)
    with pytest.raises(InvalidAggregateError, match="cannot be stored in orders"):
        rules(shop).save(None, shop.orders, {"_id": 1, "a": object()}, [], None)
    with pytest.raises(InvalidAggregateError, match="too large"):
        rules(shop).save(None, shop.orders, {"_id": 1, "a": "x" * 17_000_000}, [], None)


def test_embedded_events_count_towards_their_documents_size(shop: Any) -> None:
    big = [Event(type="x", payload={"blob": "x" * 6_000_000}) for _ in range(3)]
    rules(shop).save(None, shop.orders, {"_id": 1}, big, None)  # each entry its own document
    with pytest.raises(
        InvalidAggregateError, match="the document with its new events is too large"
    ):
        rules(shop, "embedded").save(None, shop.orders, {"_id": 1}, big, None)


def test_an_update_expecting_no_aggregate_must_be_an_upsert(shop: Any) -> None:
    with pytest.raises(InvalidAggregateError, match="pass upsert=True"):
        rules(shop).update(None, shop.orders, {"_id": 1}, {"$set": {"a": 1}}, [], False, 0)


def test_an_upsert_expecting_a_stored_version_does_not_insert(shop: Any) -> None:
    plan = rules(shop).update(None, shop.orders, {"_id": 1}, {"$set": {"a": 1}}, [], True, 4)
    assert plan.upsert is False
    plan = rules(shop).update(None, shop.orders, {"_id": 1}, {"$set": {"a": 1}}, [], True, None)
    assert plan.upsert is True


def test_an_upsert_may_not_name_a_field_the_outbox_owns_in_its_filter(shop: Any) -> None:
    query = {"_id": 1, "$or": [{"_version": 3}, {"a": 1}]}
    with pytest.raises(InvalidAggregateError, match="names '_version', a field the outbox owns"):
        rules(shop).update(None, shop.orders, query, {"$set": {"a": 1}}, [], True, None)


def test_an_update_that_the_driver_could_not_send_is_refused_before_the_write(shop: Any) -> None:
    with pytest.raises(InvalidAggregateError, match="the filter or update cannot be sent"):
        rules(shop).update(None, shop.orders, {"_id": 1}, {"$inc": {"a": 2**64}}, [], False, None)


def test_a_uuid_id_needs_its_representation_on_the_database_to_reserve_event_ids(
    shop: Any,
) -> None:
    with pytest.raises(InvalidAggregateError, match="needs a uuidRepresentation on the database"):
        embedded(shop).check_registry_id(uuid.uuid4(), "orders")
    standard = CodecOptions(uuid_representation=UuidRepresentation.STANDARD)
    embedded(shop.client.get_database("shop", codec_options=standard)).check_registry_id(
        uuid.uuid4(), "orders"
    )


def test_delete_and_add_events_are_refused_in_embedded_mode(shop: Any) -> None:
    with pytest.raises(UsageError, match="not available in embedded mode"):
        rules(shop, "embedded").delete(None, shop.orders, {"_id": 1}, [], None)
    with pytest.raises(UsageError, match="add_events is for collection mode"):
        rules(shop, "embedded").add(Session(shop.client), shop.orders, 1, [])


def test_deleting_what_must_not_exist_is_refused(shop: Any) -> None:
    with pytest.raises(InvalidAggregateError, match="there is nothing to delete"):
        rules(shop).delete(None, shop.orders, {"_id": 1}, [], 0)


def test_add_events_needs_the_callers_open_transaction(shop: Any) -> None:
    for session in (None, Session(shop.client, in_transaction=False)):
        with pytest.raises(UsageError, match="inside an open transaction"):
            rules(shop).add(session, shop.orders, 1, [Event(type="x")])
    plan = rules(shop).add(Session(shop.client), shop.orders, 1, [Event(type="x")])
    assert plan.query == {"_id": 1} and plan.kind == "add"


@pytest.mark.parametrize("mode", ["collection", "embedded"])
def test_a_database_collection_or_client_given_as_the_session_is_refused(
    shop: Any, mode: str
) -> None:
    # Each answers client, in_transaction and has_ended with a sub-object, so it passed for a
    # session: a NotImplementedError (a collection's truth tested) or "another client".
    for given in (shop, shop.orders, shop.client):
        with pytest.raises(UsageError, match="the session must be a session of the outbox"):
            rules(shop, mode).save(given, shop.orders, {"_id": 1}, [Event(type="p")], None)


def test_one_event_instead_of_a_list_is_refused_saying_so(shop: Any) -> None:
    # A pydantic model iterates as its (field, value) pairs: "expected an Event, got tuple".
    one = Event(type="placed")
    with pytest.raises(InvalidEventError, match=r"not one Event: write \[event\]") as refused:
        rules(shop).save(None, shop.orders, {"_id": 1}, one, None)  # type: ignore[arg-type]
    assert refused.value.event_id == one.id
