"""The write side's layouts (``_write/layout.py``), one per mode, with scripted replies and no
database: which fields each owns, which writes it takes, the indexes it asks for, and how it
writes entries around the aggregate document's write (collection mode inserts them beside it,
embedded mode reserves the ids that can collide before it and takes them back after a refusal).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import pytest
from pymongo import WriteConcern
from pymongo.errors import BulkWriteError, WriteConcernError

from mongo_outbox import Event
from mongo_outbox._steps import Steps, call
from mongo_outbox._write.layout import Layout
from mongo_outbox._write.plan import Plan, Written
from mongo_outbox._write.rules import Rules
from mongo_outbox.errors import (
    ConcurrencyError,
    DuplicateEventError,
    DuplicateSequenceError,
    InvalidAggregateError,
    UsageError,
)
from mongo_outbox.sync import Outbox
from tests.support.layouts import embedded, layout
from tests.support.scripted import Turn, play

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def saving(shop: Any, where: Layout, *events: Event) -> Plan:
    return Rules(shop, where, {}, where.owned).save(None, shop.orders, {"_id": 7}, events, None)


def test_collection_mode_owns_the_counters_and_embedded_mode_its_bookkeeping_fields_too(
    shop: Any,
) -> None:
    assert layout(shop).owned == {"_version", "_sequence"}
    assert embedded(shop).owned == {
        "_version",
        "_sequence",
        "_outbox",
        "_outbox_due",
        "_outbox_claim",
        "_outbox_wait",
        "_outbox_sent",
        "_outbox_partition",
    }
    assert layout(shop).partition_field == "partition"
    assert embedded(shop).partition_field == "_outbox_partition"


def test_an_outbox_names_the_fields_it_owns_for_the_odm_integrations(shop: Any) -> None:
    assert Outbox(shop).owned_fields == {"_version", "_sequence"}
    embedded_outbox = Outbox(shop, mode="embedded", collections=["orders"], field="_events")
    assert embedded_outbox.owned_fields == {
        "_version",
        "_sequence",
        "_events",
        "_events_due",
        "_events_claim",
        "_events_wait",
        "_events_sent",
        "_events_partition",
    }


def test_only_collection_mode_runs_a_transaction_of_its_own_and_not_inside_the_callers(
    shop: Any,
) -> None:
    class InTransaction:  # FAKE session: the layouts read only this attribute
        in_transaction = True

    assert layout(shop).own_transaction(None)
    assert not layout(shop).own_transaction(InTransaction())
    assert not embedded(shop).own_transaction(None)


def test_embedded_mode_refuses_deletes_and_added_events_and_collection_mode_takes_them(
    shop: Any,
) -> None:
    for kind in ("delete", "add"):
        layout(shop).check_supported(kind, "orders")
    with pytest.raises(UsageError, match="not available in embedded mode"):
        embedded(shop).check_supported("delete", "orders")
    with pytest.raises(UsageError, match="add_events is for collection mode"):
        embedded(shop).check_supported("add", "orders")
    embedded(shop).check_supported("save", "orders")


def test_only_embedded_mode_checks_the_collections_write_concern_outside_a_transaction(
    shop: Any,
) -> None:
    unacknowledged = shop.get_collection("orders", write_concern=WriteConcern(w=0))
    layout(shop).check_target(unacknowledged, None)  # its transaction's write concern counts
    with pytest.raises(InvalidAggregateError, match="writes unacknowledged"):
        embedded(shop).check_target(unacknowledged, None)


def index_names(steps: Steps[None]) -> list[tuple[str, str]]:
    """Each index the steps create, as (collection, name); every reply is None."""
    names = []
    reply = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration:
            return names
        assert step.method == "create_index"
        names.append((step.target.name, step.kwargs["name"]))


def test_a_relay_group_gets_a_partition_index_first_in_either_mode(shop: Any) -> None:
    assert index_names(layout(shop).indexes(1)) == [
        ("outbox", "relay_due"),
        ("outbox", "aggregate"),
        ("outbox", "ttl"),
        ("outbox", "waiting"),
        ("outbox", "aggregate_sequence"),
    ]
    assert index_names(layout(shop).indexes(3))[0] == ("outbox", "relay_partition_due")
    per_collection = ["_outbox_relay_due", "_outbox_parked", "_outbox_wait"]
    assert index_names(embedded(shop, ("orders", "carts")).indexes(1)) == [
        *[("orders", name) for name in per_collection],
        *[("carts", name) for name in per_collection],
        ("outbox_event_ids", "ttl"),
    ]
    assert index_names(embedded(shop).indexes(2))[0] == ("orders", "_outbox_partition_due")


# Collection mode: the entries go into the outbox collection once the document is written.


def pending(plan: Plan, first: int, **extra: Any) -> list[dict[str, Any]]:
    state = {"status": "pending", "available_at": NOW, "attempts": 0, **extra}
    return [entry | {"sequence": first + i} | state for i, entry in enumerate(plan.entries)]


def held(reply: Any = None) -> Turn:
    """The look-up of a write that numbers from 1: the aggregate's highest numbered entry."""
    query = {"aggregate_type": "orders", "aggregate_id": 7, "sequence": {"$type": "number"}}
    options = {"sort": [("sequence", -1)], "session": None}
    return Turn("find_one", (query, {"sequence": 1, "_id": 0}), options, reply, target="outbox")


def test_collection_mode_inserts_one_entry_with_insert_one_and_several_with_insert_many(
    shop: Any,
) -> None:
    where = layout(shop)
    one = saving(shop, where, Event(type="placed"))
    [entry] = pending(one, 5)
    play(
        where.insert_entries(one, 5, True, NOW, None),
        Turn("insert_one", (entry,), {"session": None}, target="outbox"),
    )
    two = saving(shop, where, Event(type="placed"), Event(type="paid"))
    play(
        where.insert_entries(two, 1, True, NOW, None),
        held(),
        Turn("insert_many", (pending(two, 1),), {"session": None}, target="outbox"),
    )


def test_collection_mode_stores_the_partition_with_each_entry_and_nothing_without_events(
    shop: Any,
) -> None:
    where = layout(shop)
    plan = replace(saving(shop, where, Event(type="placed")), partition=2)
    [entry] = pending(plan, 1, partition=2)
    play(
        where.insert_entries(plan, 1, True, NOW, None),
        held(),
        Turn("insert_one", (entry,), {"session": None}, target="outbox"),
    )
    play(where.insert_entries(saving(shop, where), 1, True, NOW, None))  # no call at all


def test_collection_mode_calls_an_event_id_already_in_the_outbox_a_duplicate_event(
    shop: Any,
) -> None:
    where = layout(shop)
    plan = saving(shop, where, Event(type="placed"), Event(type="paid"))
    taken = BulkWriteError({"writeErrors": [{"index": 1, "code": 11000, "errmsg": "dup"}]})
    with pytest.raises(DuplicateEventError, match="already in outbox"):
        play(
            where.insert_entries(plan, 3, True, NOW, None),
            Turn("insert_many", (pending(plan, 3),), {"session": None}, raises=taken),
        )
    other = BulkWriteError({"writeErrors": [{"index": 0, "code": 2, "errmsg": "bad"}]})
    with pytest.raises(BulkWriteError):
        play(
            where.insert_entries(plan, 3, True, NOW, None),
            Turn("insert_many", (pending(plan, 3),), {"session": None}, raises=other),
        )


def test_collection_mode_looks_an_aggregate_up_before_numbering_from_1_unless_it_created_it(
    shop: Any,
) -> None:
    where = layout(shop)
    plan = saving(shop, where, Event(type="placed"))
    [entry] = pending(plan, 1)
    insert = Turn("insert_one", (entry,), {"session": None}, target="outbox")
    play(where.insert_entries(plan, 1, True, NOW, None), held(), insert)  # maybe replaced
    play(where.insert_entries(plan, 1, False, NOW, None), insert)  # the write created it


def test_collection_mode_refuses_a_sequence_the_outbox_holds_for_the_aggregate(
    shop: Any,
) -> None:
    where = layout(shop)
    plan = saving(shop, where, Event(type="placed"), Event(type="paid"))
    # Numbering from 1 while the outbox holds the aggregate's events up to 4: found first.
    with pytest.raises(DuplicateSequenceError, match="up to sequence 4") as found:
        play(where.insert_entries(plan, 1, True, NOW, None), held({"sequence": 4}))
    assert (found.value.aggregate_type, found.value.aggregate_id) == ("orders", 7)
    # Numbering from 3 over a 4 the outbox holds: the unique index finds it, the server or the
    # emulator naming its key, or only the index in its message.
    key = {"aggregate_id": 7, "aggregate_type": "orders", "sequence": 1}
    on_sequence = {"code": 11000, "keyPattern": key, "keyValue": key | {"sequence": 4}}
    named = {"code": 11000, "errmsg": "E11000 index: aggregate_sequence dup key: { }"}
    for error, sequence in ((on_sequence, 4), (named, None)):
        taken = BulkWriteError({"writeErrors": [{"index": 1, **error}]})
        with pytest.raises(DuplicateSequenceError, match=f"under sequence {sequence}"):
            play(
                where.insert_entries(plan, 3, True, NOW, None),
                Turn("insert_many", (pending(plan, 3),), {"session": None}, raises=taken),
            )


# Embedded mode: the document carries the entries; ids that can collide are reserved first.


def test_embedded_mode_inserts_no_entries_of_its_own(shop: Any) -> None:
    where = embedded(shop)
    play(where.insert_entries(saving(shop, where, Event(type="placed")), 1, True, NOW, None))


def written() -> Turn:
    """The document write ``record`` runs (here a scripted call to orders)."""
    return Turn("find_one_and_update", ({"_id": 7},), {}, {"ok": 1}, target="orders")


def document_write(shop: Any) -> Any:
    def write(plan: Plan, session: Any) -> Steps[Written]:
        yield call(shop.orders, "find_one_and_update", {"_id": plan.doc_id})
        return plan.doc_id, 1, list(plan.events)

    return write


def reserve(ids: list[str]) -> Turn:
    entries = [{"_id": i, "collection": "orders", "aggregate": 7} for i in ids]
    return Turn(
        "insert_many", (entries,), {"ordered": False, "session": None}, target="outbox_event_ids"
    )


def release(ids: list[str]) -> Turn:
    query = {
        "_id": {"$in": ids},
        "collection": "orders",
        "aggregate": 7,
        "published": {"$ne": True},
    }
    return Turn("delete_many", (query,), {"session": None}, target="outbox_event_ids")


def test_an_id_the_library_made_is_not_reserved_and_the_save_is_the_document_write_alone(
    shop: Any,
) -> None:
    where = embedded(shop)
    plan = saving(shop, where, Event(type="placed"))
    doc_id, _, _ = play(where.record(plan, None, document_write(shop)), written())
    assert doc_id == 7


def test_a_chosen_id_is_reserved_before_the_document_write_which_refuses_it_if_there(
    shop: Any,
) -> None:
    where = embedded(shop)
    seen: list[tuple[str, ...]] = []

    def write(plan: Plan, session: Any) -> Steps[Written]:
        seen.append(plan.may_be_stored)
        return (yield from document_write(shop)(plan, session))

    plan = saving(shop, where, Event(id="order-7-placed", type="placed"))
    play(where.record(plan, None, write), reserve(["order-7-placed"]), written())
    assert seen == [("order-7-placed",)]


def test_a_refused_document_write_takes_its_reservations_back_and_raises_the_refusal(
    shop: Any,
) -> None:
    where = embedded(shop)
    event = Event(id="order-7-placed", type="placed")
    plan = saving(shop, where, event)
    refusal = ConcurrencyError("moved on", collection="orders", aggregate_id=7, expected_version=2)
    steps = where.record(plan, None, document_write(shop))
    with pytest.raises(ConcurrencyError) as raised:
        play(
            steps,
            reserve([event.id]),
            Turn("find_one_and_update", ({"_id": 7},), raises=refusal),
            release([event.id]),
        )
    assert raised.value is refusal
    assert not event._given  # forgotten: a retry of it is a first save again


def test_a_write_concern_error_keeps_the_reservations_because_the_write_happened(
    shop: Any,
) -> None:
    where = embedded(shop)
    event = Event(id="order-7-placed", type="placed")
    plan = saving(shop, where, event)
    late = WriteConcernError("waiting for replication timed out")
    with pytest.raises(WriteConcernError):
        play(
            where.record(plan, None, document_write(shop)),
            reserve([event.id]),
            Turn("find_one_and_update", ({"_id": 7},), raises=late),
        )  # and no delete_many: the script ends here
    assert event._given


def test_embedded_mode_adds_its_entries_due_time_and_partition_to_a_new_document(
    shop: Any,
) -> None:
    where = embedded(shop)
    plan = replace(saving(shop, where, Event(type="placed")), partition=1)
    fields = where.inserted(plan, NOW)
    assert [e["sequence"] for e in fields["_outbox"]] == [1]
    assert fields["_outbox_due"] == NOW and fields["_outbox_partition"] == 1
    assert layout(shop).inserted(plan, NOW) == {}
    empty = where.inserted(saving(shop, where), NOW)
    assert empty == {"_outbox": []}  # no events: nothing due


def test_an_operator_update_without_events_gets_nothing_from_embedded_mode(shop: Any) -> None:
    where = embedded(shop)
    assert where.operators(saving(shop, where), NOW) == {}
    one = saving(shop, where, Event(type="placed"))
    assert where.operators(one, NOW) == {
        "$push": {"_outbox": one.entries[0]},
        "$max": {"_outbox_due": NOW},
    }
    two = saving(shop, where, Event(type="placed"), Event(type="paid"))
    assert where.operators(two, NOW)["$push"] == {"_outbox": {"$each": two.entries}}


def test_a_save_keeps_the_relays_fields_and_only_ids_that_may_be_stored_guard_a_write(
    shop: Any,
) -> None:
    where = embedded(shop)
    plan = saving(shop, where)
    stage = where.stage(plan, NOW)
    assert stage["_outbox_claim"] == "$_outbox_claim" and stage["_outbox_sent"] == "$_outbox_sent"
    assert stage["_outbox_due"] == "$_outbox_due"  # no events: the due time stays as it is
    assert where.guard(saving(shop, where, Event(type="placed"))) == {}
    chosen = replace(saving(shop, where, Event(type="placed")), may_be_stored=("e-1",))
    held = {"$nin": ["e-1"]}
    assert where.guard(chosen) == {"_outbox.id": held, "_outbox_sent": held}
    assert layout(shop).guard(chosen) == {} and layout(shop).stage(chosen, NOW) == {}
