"""What ``update_with_events`` accepts as a filter and an update, and how the outbox adds its own
part (``_write/updates.py``): every path an update writes is checked before anything is written, so
no update reaches the fields the outbox owns or the ``_id``, whichever way it names them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mongo_outbox._write.updates import (
    OPERATORS,
    check_array_filters,
    check_update,
    check_upsert_filter,
    guarded,
    id_of,
    with_operators,
)
from mongo_outbox.errors import InvalidAggregateError

OWNED = frozenset({"_version", "_sequence", "_outbox"})
FORBIDDEN = sorted({"_id", *OWNED})


@pytest.mark.parametrize(
    ("query", "doc_id"), [({"_id": 3}, 3), ({"_id": {"$eq": "a"}, "s": 1}, "a")]
)
def test_the_filter_names_its_aggregate_by_id_as_a_value_or_eq(query: Any, doc_id: Any) -> None:
    assert id_of(query, "orders") == doc_id


@pytest.mark.parametrize(
    ("query", "why"),
    [
        ({"status": "open"}, "must name the aggregate by _id"),
        ({"_id": {"$in": [1, 2]}}, "must match one document at most"),
        ({"_id": {"$eq": 1, "$ne": 2}}, "must match one document at most"),
        ([("_id", 1)], "must be a mapping"),
    ],
)
def test_a_filter_that_could_match_more_than_one_aggregate_is_refused(query: Any, why: str) -> None:
    with pytest.raises(InvalidAggregateError, match=why):
        id_of(query, "orders")


@given(
    owned=st.sampled_from(FORBIDDEN),
    rest=st.sampled_from(["", ".n", ".$", ".$[]", ".$[i].x", ".0"]),
    operator=st.sampled_from(sorted(OPERATORS - {"$rename"})),
)
def test_no_operator_writes_an_owned_field_or_the_id_by_any_path(
    owned: str, rest: str, operator: str
) -> None:
    with pytest.raises(InvalidAggregateError, match=f"writes '{owned}"):
        check_update({operator: {owned + rest: 1}}, OWNED, "orders")


@given(owned=st.sampled_from(FORBIDDEN), to_it=st.booleans())
def test_a_rename_may_neither_take_an_owned_field_nor_give_one(owned: str, to_it: bool) -> None:
    spec = {"mine": owned} if to_it else {owned: "mine"}
    with pytest.raises(InvalidAggregateError, match=f"writes '{owned}'"):
        check_update({"$rename": spec}, OWNED, "orders")


@pytest.mark.parametrize(
    "stage",
    [
        {"$set": {"_version": 1}},
        {"$addFields": {"_outbox.x": 1}},
        {"$unset": "_sequence"},
        {"$unset": ["a", "_id"]},
    ],
)
def test_no_pipeline_stage_writes_an_owned_field_or_the_id(stage: dict[str, Any]) -> None:
    with pytest.raises(InvalidAggregateError, match="writes '"):
        check_update([{"$set": {"a": 1}}, stage], OWNED, "orders")


@pytest.mark.parametrize("operator", ["$project", "$replaceWith", "$replaceRoot"])
def test_a_pipeline_stage_that_replaces_the_document_is_refused(operator: str) -> None:
    with pytest.raises(InvalidAggregateError, match="replaces the whole document"):
        check_update([{operator: {"a": 1}}], OWNED, "orders")


@pytest.mark.parametrize(
    ("update", "why"),
    [
        ({}, "the update is empty"),
        ([], "the update pipeline is empty"),
        ({"status": "paid"}, "to replace the whole document use save_with_events"),
        ({"$where": {"a": 1}}, "not an update operator this outbox accepts"),
        ({"$set": [("a", 1)]}, "takes a mapping of field paths"),
        ({"$set": {"": 1}}, "is not a field path"),
        ({"$set": {"a": {"$b": 1}}}, r"key '\$b' cannot be stored"),
        ({"$setOnInsert": {"a": [{"x\x00": 1}]}}, "cannot be stored in MongoDB"),
        ([{"$set": {"a": 1}, "$unset": "b"}], "a mapping of one stage operator"),
        ([{"$match": {"a": 1}}], "is not accepted"),
        ("$set", "not str"),
    ],
)
def test_an_update_mongodb_would_refuse_or_misread_is_refused_first(update: Any, why: str) -> None:
    with pytest.raises(InvalidAggregateError, match=why):
        check_update(update, OWNED, "orders")


def test_operators_whose_values_are_conditions_keep_their_dollar_keys() -> None:
    update = {
        "$pull": {"items": {"qty": {"$lt": 1}}},
        "$push": {"log": {"$each": [1], "$slice": -5}},
    }
    assert check_update(update, OWNED, "orders") == update


def test_a_checked_update_is_a_copy_the_outbox_may_add_to() -> None:
    update = {"$set": {"a": 1}}
    checked = check_update(update, OWNED, "orders")
    merged = with_operators(checked, {"$set": {"_due": 1}, "$inc": {"_version": 1}, "$unset": {}})
    assert merged == {"$set": {"a": 1, "_due": 1}, "$inc": {"_version": 1}}
    assert update == {"$set": {"a": 1}} and checked == {"$set": {"a": 1}}


def test_an_operator_with_no_field_is_not_sent() -> None:
    # An ODM's save of an unchanged document: the events go, no field is written, and MongoDB
    # before 5.0 refuses an empty $set.
    checked = check_update({"$set": {}}, OWNED, "orders")
    assert with_operators(checked, {"$inc": {"_version": 1}}) == {"$inc": {"_version": 1}}


def test_an_upsert_filter_naming_an_owned_field_at_any_depth_of_and_or_is_refused() -> None:
    check_upsert_filter({"_id": 1, "$or": [{"a": 1}, {"$and": [{"b": 2}]}]}, OWNED, "orders")
    with pytest.raises(InvalidAggregateError, match=r"names '_sequence\.x'"):
        check_upsert_filter({"_id": 1, "$or": [{"$and": [{"_sequence.x": 2}]}]}, OWNED, "orders")


def test_array_filters_are_a_list_and_only_for_an_update_of_operators() -> None:
    filters = [{"i.qty": {"$gt": 1}}]
    update = check_update({"$set": {"items.$[i].ok": True}}, OWNED, "orders")
    assert check_array_filters(filters, update, "orders") == filters
    with pytest.raises(InvalidAggregateError, match="must be a list of filter documents"):
        check_array_filters({"i.qty": 1}, update, "orders")
    pipeline = check_update([{"$set": {"a": 1}}], OWNED, "orders")
    with pytest.raises(InvalidAggregateError, match="apply to an update of operators"):
        check_array_filters(filters, pipeline, "orders")


def test_the_outbox_conditions_join_the_callers_filter_without_replacing_its_own() -> None:
    assert guarded({"_id": 1, "a": 2}, {}) == {"_id": 1, "a": 2}
    assert guarded({"_id": 1, "a": 2}, {"_version": 3}) == {"_id": 1, "a": 2, "_version": 3}
    # The caller conditions _version too: both must hold.
    assert guarded({"_id": 1, "_version": {"$gt": 0}}, {"_version": 3}) == {
        "_id": 1,
        "$and": [{"_id": 1, "_version": {"$gt": 0}}, {"_version": 3}],
    }
