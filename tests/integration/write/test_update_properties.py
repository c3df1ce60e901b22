"""Property-based: ``update_with_events`` changes an aggregate exactly as a plain ``update_one``
changes a copy of it, plus the outbox's fields; and whatever the plain update refuses, or the
outbox refuses, writes nothing.

Each example draws a document (or none, for an upsert), a filter (its ``_id``, sometimes with a
guard that may not hold), an update (random operators on random paths with random values, or a
pipeline of ``$set``/``$unset`` stages) and events; a hostile one also writes a field the outbox
owns or the ``_id``. The same update goes to a copy of the document in a plain collection with
``update_one``, then through the outbox (either mode, either API). Then:

- the outbox refused a hostile update, or the plain update failed, or matched nothing without
  upsert: the outbox raised an ``OutboxError`` and the database holds what it held before;
- otherwise the aggregate, without the outbox's fields, is the plain copy byte for byte (field
  order and types), ``_version`` moved one step, ``_sequence`` one per event, and the entries
  hold the events with those sequences.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import bson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from mongo_outbox import (
    AggregateNotFoundError,
    Event,
    InvalidAggregateError,
    OutboxError,
)
from tests.support.apis import APIS, Writer
from tests.support.contents import contents
from tests.support.outboxes import stored_entries

MODES = ["collection", "embedded"]
EXAMPLES = int(os.environ.get("UPDATE_PROPERTY_EXAMPLES", "40"))
OWNED = {
    "collection": {"_version", "_sequence"},
    "embedded": {
        "_version",
        "_sequence",
        "_outbox",
        "_outbox_due",
        "_outbox_claim",
        "_outbox_wait",
        "_outbox_sent",
    },
}

TOP = ["a", "b", "c", "arr", "doc"]
PATHS = st.sampled_from([*TOP, "doc.x", "doc.y", "arr.1"])
HOSTILE = st.sampled_from(["_version", "_sequence.x", "_outbox", "_outbox.0", "_outbox_due", "_id"])
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-4, 4),
    st.integers(2**31 - 2, 2**31 + 2),
    st.floats(-8, 8, allow_nan=False).map(lambda f: round(f, 2)),
    st.sampled_from(["", "x", "y"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["x", "y"]), inner, max_size=2)
    ),
    max_leaves=5,
)
numbers = st.one_of(st.integers(-3, 3), st.sampled_from([0.5, -1.5, 2**31]))
# Never an empty $each: mongoeco takes an update that only pushes nothing for a no-op, though
# MongoDB (and mongoeco, beside any other change) creates the empty array.
each = st.lists(values, min_size=1, max_size=3).map(lambda items: {"$each": items})


def operator_fields(operator: str) -> st.SearchStrategy[dict[str, Any]]:
    by_operator: dict[str, st.SearchStrategy[Any]] = {
        "$set": values,
        "$setOnInsert": values,
        "$min": scalars,
        "$max": scalars,
        "$unset": st.just(""),
        "$inc": numbers,
        "$mul": numbers,
        "$push": st.one_of(values, each),
        "$addToSet": st.one_of(values, each),
        "$pull": st.one_of(scalars, st.integers(-3, 3).map(lambda n: {"$gte": n})),
        "$pop": st.sampled_from([1, -1]),
    }
    if operator == "$rename":
        return st.dictionaries(
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(["d", "e", "a"]),
            min_size=1,
            max_size=2,
        )
    return st.dictionaries(PATHS, by_operator[operator], min_size=1, max_size=2)


OPERATORS = [
    "$set",
    "$setOnInsert",
    "$min",
    "$max",
    "$unset",
    "$inc",
    "$mul",
    "$push",
    "$addToSet",
    "$pull",
    "$pop",
    "$rename",
]
operator_updates = st.lists(
    st.sampled_from(OPERATORS), min_size=1, max_size=3, unique=True
).flatmap(lambda chosen: st.fixed_dictionaries({op: operator_fields(op) for op in chosen}))
expressions = st.one_of(
    values.map(lambda v: {"$literal": v}),
    st.integers(-3, 3).map(lambda n: {"$add": ["$a", n]}),
    st.just({"$concat": ["$b", "-"]}),
    values.map(lambda v: {"$ifNull": ["$c", {"$literal": v}]}),
    st.sampled_from(["$a", "$doc.x", "$arr"]),
)
stages = st.one_of(
    st.dictionaries(st.sampled_from([*TOP, "doc.x"]), expressions, min_size=1, max_size=2).map(
        lambda spec: {"$set": spec}
    ),
    st.one_of(PATHS, st.lists(PATHS, min_size=1, max_size=2)).map(lambda p: {"$unset": p}),
)
pipelines = st.lists(stages, min_size=1, max_size=3)


@st.composite
def examples(draw: st.DrawFn) -> dict[str, Any]:
    exists = draw(st.booleans()) or draw(st.booleans())
    document = {"_id": 1, **draw(st.dictionaries(st.sampled_from(TOP), values, max_size=4))}
    update: Any = draw(st.one_of(operator_updates, pipelines))
    hostile = draw(st.sampled_from([False] * 5 + [True]))
    if hostile:
        path = draw(HOSTILE)
        if isinstance(update, list):
            update = [*update, {"$set": {path: 1}}]
        else:
            update = {**update, "$unset": {path: ""}}
    query: dict[str, Any] = {"_id": 1}
    if draw(st.integers(0, 3)) == 0:
        field = draw(st.sampled_from(TOP))
        query[field] = document.get(field) if draw(st.booleans()) else draw(scalars)
    return {
        "exists": exists,
        "document": document,
        "query": query,
        "update": update,
        "upsert": draw(st.booleans()),
        "events": draw(st.integers(0, 2)),
    }


def touches(update: Any, forbidden: set[str]) -> bool:
    """Whether ``update`` writes a path starting at one of ``forbidden``."""
    paths: list[str] = []
    if isinstance(update, list):
        for stage in update:
            ((operator, spec),) = stage.items()
            paths += [spec] if isinstance(spec, str) else list(spec)
    else:
        for operator, fields in update.items():
            paths += list(fields)
            if operator == "$rename":
                paths += list(fields.values())
    return any(p.split(".")[0] in forbidden for p in paths)


@pytest.fixture(params=[(m, a) for m in MODES for a in APIS], ids=lambda p: f"{p[0]}-{p[1]}")
def variant(request: pytest.FixtureRequest) -> tuple[str, str]:
    mode, api = request.param
    return mode, api


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(example=examples())
async def test_an_update_with_events_does_what_update_one_does_plus_the_outbox_fields(
    client: Any, sync_client: MongoClient[Any], variant: tuple[str, str], example: dict[str, Any]
) -> None:
    mode, api = variant
    db = client[f"u_{uuid.uuid4().hex[:12]}"]
    try:
        await run_example(
            db, Writer(api, db, sync_client, mode=mode, collections=["orders"]), example
        )
    finally:
        await client.drop_database(db.name)


async def run_example(db: Any, writer: Writer, example: dict[str, Any]) -> None:
    mode = writer.relay_outbox.mode
    query, update, upsert = example["query"], example["update"], example["upsert"]
    if example["exists"]:
        await db.plain.insert_one(dict(example["document"]))
        await writer.save_with_events(
            None, db.orders, dict(example["document"]), [Event(type="created")], expected_version=0
        )
    created = 1 if example["exists"] else 0
    plain_failed: OperationFailure | None = None
    matched = 0
    try:
        result = await db.plain.update_one(query, update, upsert=upsert)
        matched = result.matched_count + (1 if result.upserted_id is not None else 0)
    except OperationFailure as error:
        plain_failed = error
    before = {k: v for k, v in (await contents(db)).items() if k != "plain"}
    events = [Event(type=f"e{n}") for n in range(example["events"])]
    refused: OutboxError | None = None
    try:
        saved = await writer.update_with_events(
            None, db.orders, query, update, events, upsert=upsert
        )
    except OutboxError as error:
        refused = error
    hostile = touches(update, OWNED[mode] | {"_id"})
    if refused is not None:
        after = {k: v for k, v in (await contents(db)).items() if k != "plain"}
        assert after == before, "a refused update wrote something"
        if hostile:
            event("refused: writes an owned field or the _id")
            assert isinstance(refused, InvalidAggregateError)
        elif plain_failed is not None:
            event(f"refused, as update_one was: {plain_failed.code}")
        else:
            event("refused: no match")
            assert matched == 0 and isinstance(refused, AggregateNotFoundError), refused
        return
    event("stored")
    assert not touches(update, OWNED[mode] | {"_id"}), "an update of an owned field went through"
    assert plain_failed is None and matched == 1, plain_failed
    plain = await db.plain.find_one({"_id": 1})
    stored = await db.orders.find_one({"_id": 1})
    without = {k: v for k, v in stored.items() if k not in OWNED[mode]}
    assert bson.encode(without) == bson.encode(plain), (without, plain)
    assert (saved.version, stored["_version"]) == (created + 1, created + 1)
    assert stored["_sequence"] == created + len(events)
    assert [e.sequence for e in saved.events] == [created + 1 + i for i in range(len(events))]
    if mode == "embedded":
        entries = stored_entries(stored)
    else:
        entries = (
            await db.outbox.find({"type": {"$ne": "created"}}).sort("sequence", 1).to_list(None)
        )
    assert [(e["type"], e["sequence"]) for e in entries if e["type"] != "created"] == [
        (e.type, e.sequence) for e in saved.events
    ]
