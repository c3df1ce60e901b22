"""update_with_events, both modes and both APIs: update operators and pipelines change only what
they name, counters move as for a save, and bad input writes nothing."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import pytest
from pymongo import MongoClient
from pymongo.asynchronous.collection import AsyncCollection

from mongo_outbox import (
    AggregateNotFoundError,
    ConcurrencyError,
    DuplicateEventError,
    Event,
    InvalidAggregateError,
    InvalidEventError,
    Outbox,
    PollingRelay,
    Saved,
)
from mongo_outbox._relay.store import store_for
from mongo_outbox.publishers import MemoryPublisher
from tests.support.apis import APIS, Writer
from tests.support.contents import contents
from tests.support.outboxes import stored_entries

MODES = ["collection", "embedded"]
OWNED = {
    "_version",
    "_sequence",
    "_outbox",
    "_outbox_due",
    "_outbox_claim",
    "_outbox_wait",
    "_outbox_sent",
}


@pytest.fixture(params=[(m, a) for m in MODES for a in APIS], ids=lambda p: f"{p[0]}-{p[1]}")
def writer(request: pytest.FixtureRequest, db: Any, sync_client: MongoClient[Any]) -> Writer:
    mode, api = request.param
    options = {"mode": mode, "collections": ["orders"]} if mode == "embedded" else {}
    return Writer(api, db, sync_client, **options)


def fields(document: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in document.items() if k not in OWNED}


async def pending(writer: Writer) -> list[tuple[str, Any, int]]:
    """(type, aggregate_id, sequence) of every stored entry, in sequence order."""
    db = writer.db
    if writer.relay_outbox.mode == "collection":
        entries = await db.outbox.find().sort("sequence", 1).to_list(None)
    else:
        entries = [e for d in await db.orders.find().to_list(None) for e in stored_entries(d)]
    return [(e["type"], e["aggregate_id"], e["sequence"]) for e in entries]


async def test_update_operators_change_only_the_fields_they_name(writer: Writer, db: Any) -> None:
    order = {"_id": "o1", "status": "new", "items": ["book"], "note": "keep", "total": 10}
    await writer.save_with_events(None, db.orders, order, [Event(type="placed")])
    saved = await writer.update_with_events(
        None,
        db.orders,
        {"_id": "o1"},
        {"$set": {"status": "paid"}, "$inc": {"total": 5}, "$push": {"items": "pen"}},
        [Event(type="paid", payload={"total": 15}), Event(type="noted")],
    )
    assert saved.id == "o1" and saved.version == 2
    assert [(e.sequence, e.aggregate_type, e.aggregate_id) for e in saved.events] == [
        (2, "orders", "o1"),
        (3, "orders", "o1"),
    ]
    stored = await db.orders.find_one({"_id": "o1"})
    assert fields(stored) == {
        "_id": "o1",
        "status": "paid",
        "items": ["book", "pen"],
        "note": "keep",
        "total": 15,
    }
    assert (stored["_version"], stored["_sequence"]) == (2, 3)
    assert await pending(writer) == [("placed", "o1", 1), ("paid", "o1", 2), ("noted", "o1", 3)]
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.relay_outbox, publisher).drain() == 3
    assert [(e.type, e.sequence) for e in publisher.events] == [
        ("placed", 1),
        ("paid", 2),
        ("noted", 3),
    ]
    assert publisher.events[1] == saved.events[0]


async def test_a_sequence_the_caller_gave_is_numbered_over_as_every_write_does(
    writer: Writer, db: Any
) -> None:
    # An event copied from another (model_copy), or built with a sequence: an embedded update
    # of operators pushed it as it was, and the relay published 1, 99, 1 where Saved said 1, 2,
    # 3 (a consumer checking sequences would drop the last as stale).
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a", sequence=5)])
    for n, (kind, numbered) in enumerate([("b", 99), ("c", 1)]):
        update = {"$set": {"x": n}}
        await writer.update_with_events(
            None, db.orders, {"_id": 1}, update, [Event(type=kind, sequence=numbered)]
        )
    pipeline = [{"$set": {"y": 1}}]
    await writer.update_with_events(None, db.orders, {"_id": 1}, pipeline, [Event(type="d")])
    assert [s for _, _, s in await pending(writer)] == [1, 2, 3, 4]
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.relay_outbox, publisher).drain() == 4
    assert [(e.type, e.sequence) for e in publisher.events] == [
        ("a", 1),
        ("b", 2),
        ("c", 3),
        ("d", 4),
    ]


async def test_a_pipeline_update_reads_the_stored_fields(writer: Writer, db: Any) -> None:
    await writer.save_with_events(None, db.orders, {"_id": 1, "a": 2, "b": 3, "gone": 1}, [])
    saved = await writer.update_with_events(
        None,
        db.orders,
        {"_id": 1},
        [{"$set": {"sum": {"$add": ["$a", "$b"]}}}, {"$unset": "gone"}],
        [Event(type="summed")],
    )
    assert saved.version == 2 and saved.events[0].sequence == 1
    stored = await db.orders.find_one({"_id": 1})
    assert fields(stored) == {"_id": 1, "a": 2, "b": 3, "sum": 5}
    assert await pending(writer) == [("summed", 1, 1)]


async def test_an_update_without_events_moves_only_the_version(writer: Writer, db: Any) -> None:
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    saved = await writer.update_with_events(None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [])
    assert (saved.version, saved.events) == (2, [])
    stored = await db.orders.find_one({"_id": 1})
    assert (stored["x"], stored["_version"], stored["_sequence"]) == (1, 2, 1)


async def test_filter_conditions_beside_the_id_guard_the_update(writer: Writer, db: Any) -> None:
    await writer.save_with_events(None, db.orders, {"_id": 1, "status": "open"}, [])
    await writer.update_with_events(
        None, db.orders, {"_id": 1, "status": "open"}, {"$set": {"status": "closed"}}, []
    )
    before = await contents(db)
    with pytest.raises(AggregateNotFoundError, match="not the rest of the filter") as caught:
        await writer.update_with_events(
            None,
            db.orders,
            {"_id": {"$eq": 1}, "status": "open"},
            {"$set": {"status": "closed"}},
            [Event(type="closed")],
        )
    assert (caught.value.collection, caught.value.aggregate_id) == ("orders", 1)
    assert await contents(db) == before


async def test_no_match_without_upsert_raises_and_writes_nothing(writer: Writer, db: Any) -> None:
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    before = await contents(db)
    with pytest.raises(AggregateNotFoundError, match="no document has that _id"):
        await writer.update_with_events(
            None, db.orders, {"_id": 2}, {"$set": {"x": 1}}, [Event(type="b")]
        )
    assert await contents(db) == before


async def test_upsert_creates_the_aggregate_with_its_events(writer: Writer, db: Any) -> None:
    created = await writer.update_with_events(
        None,
        db.orders,
        {"_id": "o1", "kind": "web"},
        {"$set": {"status": "new"}, "$inc": {"lines": 1}},
        [Event(type="placed")],
        upsert=True,
    )
    assert created.version == 1 and created.events[0].sequence == 1
    again = await writer.update_with_events(
        None, db.orders, {"_id": "o1"}, {"$inc": {"lines": 1}}, [Event(type="grew")], upsert=True
    )
    assert again.version == 2 and again.events[0].sequence == 2
    stored = await db.orders.find_one({"_id": "o1"})
    assert fields(stored) == {"_id": "o1", "kind": "web", "status": "new", "lines": 2}
    fresh = await writer.update_with_events(
        None,
        db.orders,
        {"_id": "o2"},
        [{"$set": {"lines": 1}}],
        [Event(type="placed")],
        upsert=True,
        expected_version=0,
    )
    assert fresh.version == 1 and fresh.events[0].sequence == 1
    assert sorted(await pending(writer)) == [
        ("grew", "o1", 2),
        ("placed", "o1", 1),
        ("placed", "o2", 1),
    ]


async def test_expected_version_guards_the_update(writer: Writer, db: Any) -> None:
    first = await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    await db.orders.insert_one({"_id": 2, "note": "written without the outbox"})
    before = await contents(db)
    attempts: list[tuple[Any, int]] = [(1, 0), (1, 2), (1, 5), (2, 0), (2, 1), (3, 1)]
    for doc_id, expected in attempts:
        with pytest.raises(ConcurrencyError) as caught:
            await writer.update_with_events(
                None,
                db.orders,
                {"_id": doc_id},
                {"$set": {"x": 1}},
                [Event(type="b")],
                upsert=expected == 0,
                expected_version=expected,
            )
        assert caught.value.expected_version == expected
    assert await contents(db) == before
    saved = await writer.update_with_events(
        None,
        db.orders,
        {"_id": 1},
        {"$set": {"x": 1}},
        [Event(type="b")],
        expected_version=first.version,
    )
    assert saved.version == 2 and saved.events[0].sequence == 2


async def test_an_update_of_a_document_written_without_the_outbox_starts_its_counters(
    writer: Writer, db: Any
) -> None:
    await db.orders.insert_one({"_id": 1, "note": "legacy"})
    saved = await writer.update_with_events(
        None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [Event(type="a"), Event(type="b")]
    )
    assert saved.version == 1 and [e.sequence for e in saved.events] == [1, 2]
    stored = await db.orders.find_one({"_id": 1})
    assert fields(stored) == {"_id": 1, "note": "legacy", "x": 1}


@pytest.mark.parametrize(
    "counters", [{}, {"_version": None, "_sequence": None}], ids=["absent", "null"]
)
async def test_counters_absent_or_null_start_at_zero_for_a_pipeline_update_and_a_guarded_save(
    writer: Writer, db: Any, counters: dict[str, Any]
) -> None:
    # A missing or null counter counts as 0 ($ifNull in the pipeline), in what is stored and
    # in what Saved returns.
    await db.orders.insert_one({"_id": 1, "n": 1, **counters})
    saved = await writer.update_with_events(
        None, db.orders, {"_id": 1}, [{"$set": {"n": {"$add": ["$n", 1]}}}], [Event(type="a")]
    )
    assert saved.version == 1 and [e.sequence for e in saved.events] == [1]
    again = await writer.save_with_events(
        None, db.orders, {"_id": 1, "n": 5}, [Event(type="b"), Event(type="c")], expected_version=1
    )
    assert again.version == 2 and [e.sequence for e in again.events] == [2, 3]
    stored = await db.orders.find_one({"_id": 1})
    assert (stored["_version"], stored["_sequence"], stored["n"]) == (2, 3, 5)
    assert [s for _, _, s in await pending(writer)] == [1, 2, 3]


def refused_updates(mode: str) -> list[tuple[Any, Any]]:
    """(filter, update) pairs refused before anything is written."""
    owned = ["_version", "_sequence"]
    if mode == "embedded":
        owned += ["_outbox", "_outbox_due", "_outbox_claim", "_outbox_wait", "_outbox_sent"]
    cases: list[tuple[Any, Any]] = []
    for name in owned:
        cases += [
            ({"_id": 1}, {"$set": {name: 1}}),
            ({"_id": 1}, {"$inc": {f"{name}.0": 1}}),
            ({"_id": 1}, {"$unset": {name: ""}}),
            ({"_id": 1}, {"$rename": {"a": name}}),
            ({"_id": 1}, {"$rename": {name: "a"}}),
            ({"_id": 1}, [{"$set": {name: 1}}]),
            ({"_id": 1}, [{"$addFields": {f"{name}.x": 1}}]),
            ({"_id": 1}, [{"$unset": [name]}]),
            ({"_id": 1}, [{"$unset": name}]),
        ]
    cases += [
        ({"_id": 1}, {"$set": {"_id": 2}}),
        ({"_id": 1}, {"$setOnInsert": {"_id": 2}}),
        ({"_id": 1}, {"$set": {"a": {"$bad": 1}}}),
        ({"_id": 1}, {"$set": {"a": object()}}),
        ({"_id": 1}, [{"$replaceWith": {"a": 1}}]),
        ({"_id": 1}, [{"$replaceRoot": {"newRoot": {"a": 1}}}]),
        ({"_id": 1}, [{"$project": {"a": 1}}]),
        ({"_id": 1}, [{"$match": {}}]),
        ({"_id": 1}, []),
        ({"_id": 1}, {}),
        ({"_id": 1}, {"a": 1}),
        ({"_id": 1}, {"$foo": {"a": 1}}),
        ({"_id": 1}, {"$set": [("a", 1)]}),
        ({"_id": 1}, "$set"),
        ({"status": "open"}, {"$set": {"a": 1}}),
        ({"_id": {"$in": [1, 2]}}, {"$set": {"a": 1}}),
        ({"_id": {"$gt": 0}}, {"$set": {"a": 1}}),
        ({"_id": {"compound": 1}}, {"$set": {"a": 1}}),
        ({"_id": "65a1b2c3d4e5f6a7b8c9d0e1"}, {"$set": {"a": 1}}),
        ({"_id": 1, "x": object()}, {"$set": {"a": 1}}),
        ([("_id", 1)], {"$set": {"a": 1}}),
    ]
    return cases


async def test_bad_updates_raise_before_anything_is_written(writer: Writer, db: Any) -> None:
    await writer.save_with_events(None, db.orders, {"_id": 1, "a": 0}, [Event(type="a")])
    await writer.ensure_indexes()
    before = await contents(db)
    mode = writer.relay_outbox.mode
    for query, update in refused_updates(mode):
        with pytest.raises(InvalidAggregateError) as caught:
            await writer.update_with_events(None, db.orders, query, update, [Event(type="b")])
        assert caught.value.collection == "orders", (query, update)
    for options in ({"expected_version": 0}, {"expected_version": -1}, {"upsert": "yes"}):
        with pytest.raises(InvalidAggregateError):
            await writer.update_with_events(
                None, db.orders, {"_id": 1}, {"$set": {"a": 1}}, [Event(type="b")], **options
            )
    for events in ([Event(type="x", aggregate_id=2)], [{"type": "not an Event"}]):
        with pytest.raises(InvalidEventError):
            await writer.update_with_events(None, db.orders, {"_id": 1}, {"$set": {"a": 1}}, events)
    assert await contents(db) == before


async def test_updates_mongodb_refuses_raise_an_outbox_error_and_write_nothing(
    writer: Writer, db: Any
) -> None:
    await writer.save_with_events(
        None, db.orders, {"_id": 1, "name": "x", "n": 1}, [Event(type="a")]
    )
    await writer.ensure_indexes()
    before = await contents(db)
    updates: tuple[Any, ...] = (
        {"$inc": {"name": 1}},
        {"$push": {"n": 2}},
        {"$set": {"n.deep": 1}},
        {"$set": {"a": 1}, "$inc": {"a": 1}},
        {"$pop": {"n": 2}},
        [{"$set": {"x": {"$nosuchop": 1}}}],  # 168 on the emulator and on MongoDB
        [{"$set": {"x": "$$nosuchvar"}}],
    )
    for update in updates:
        with pytest.raises(InvalidAggregateError, match="MongoDB refused the update"):
            await writer.update_with_events(
                None, db.orders, {"_id": 1}, update, [Event(type="b"), Event(type="c")]
            )
    assert await contents(db) == before


async def test_an_update_repeated_after_it_succeeded_is_refused(writer: Writer, db: Any) -> None:
    await writer.save_with_events(None, db.orders, {"_id": 1}, [])
    event = Event(type="paid")
    await writer.update_with_events(None, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [event])
    before = await contents(db)
    with pytest.raises(DuplicateEventError):
        await writer.update_with_events(None, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [event])
    with pytest.raises(DuplicateEventError):  # another aggregate, same event id
        await writer.update_with_events(
            None, db.orders, {"_id": 2}, {"$inc": {"n": 1}}, [event], upsert=True
        )
    assert await contents(db) == before


@pytest.mark.parametrize("api", APIS)
async def test_an_embedded_update_leaves_the_relays_claim_and_due_time_alone(
    db: Any, sync_client: MongoClient[Any], api: str
) -> None:
    writer = Writer(api, db, sync_client, mode="embedded", collections=["orders"])
    await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    stored = await db.orders.find_one({"_id": 1})
    later = stored["_outbox_due"].replace(year=stored["_outbox_due"].year + 1)
    relay_fields = {"_outbox_due": later, "_outbox_claim": "token", "_outbox_wait": True}
    await db.orders.update_one({"_id": 1}, {"$set": relay_fields})
    for update in ({"$set": {"x": 1}}, [{"$set": {"y": 2}}]):
        await writer.update_with_events(None, db.orders, {"_id": 1}, update, [Event(type="b")])
    stored = await db.orders.find_one({"_id": 1})
    assert {k: stored[k] for k in relay_fields} == relay_fields
    assert [e["sequence"] for e in stored_entries(stored)] == [1, 2, 3]
    assert (stored["x"], stored["y"]) == (1, 2)


@pytest.mark.parametrize("mode", MODES)
async def test_an_update_joins_the_callers_transaction(
    client: Any, db: Any, sync_client: MongoClient[Any], mode: str
) -> None:
    writer = Writer("async", db, sync_client, mode=mode, collections=["orders"])
    await writer.save_with_events(None, db.orders, {"_id": 1, "n": 0}, [])
    async with client.start_session() as session:
        with pytest.raises(RuntimeError):
            async with await session.start_transaction():
                await writer.update_with_events(
                    session, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [Event(type="a")]
                )
                raise RuntimeError("abort on purpose")
        async with await session.start_transaction():
            await db.audit.insert_one({"_id": "x"}, session=session)
            await writer.update_with_events(
                session, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [Event(type="b")]
            )
    stored = await db.orders.find_one({"_id": 1})
    assert (stored["n"], stored["_version"]) == (1, 2)
    assert await pending(writer) == [("b", 1, 1)]


@pytest.mark.parametrize("mode", MODES)
def test_a_sync_update_joins_the_callers_transaction(
    sync_client: MongoClient[Any], mode: str
) -> None:
    from mongo_outbox.sync import Outbox

    db = sync_client["t_sync_txn_" + mode]
    sync_client.drop_database(db.name)
    try:
        outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
        outbox.save_with_events(None, db.orders, {"_id": 1, "n": 0}, [])
        with sync_client.start_session() as session:
            with pytest.raises(RuntimeError), session.start_transaction():
                outbox.update_with_events(
                    session, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [Event(type="a")]
                )
                raise RuntimeError("abort on purpose")
            with session.start_transaction():
                db.audit.insert_one({"_id": "x"}, session=session)
                saved = outbox.update_with_events(
                    session, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [Event(type="b")]
                )
                assert session.in_transaction
        assert saved.version == 2 and saved.events[0].sequence == 1
        stored = db.orders.find_one({"_id": 1})
        assert stored is not None and (stored["n"], stored["_version"]) == (1, 2)
        assert db.audit.count_documents({}) == 1
    finally:
        sync_client.drop_database(db.name)


class CollectionWithAHookBeforeItsWrite(AsyncCollection[Any]):
    """A fake around the real collection: its first ``find_one_and_update`` runs the hooks
    before it writes, to put a relay's round right before the outbox's write."""

    hooks: ClassVar[list[Any]] = []

    async def find_one_and_update(self, *args: Any, **kwargs: Any) -> Any:
        while self.hooks:
            await self.hooks.pop()()
        return await super().find_one_and_update(*args, **kwargs)


async def test_an_embedded_update_racing_a_relays_settle_still_makes_its_events_due(
    db: Any,
) -> None:
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])

    async def relay_publishes_meanwhile() -> None:
        # The relay publishes "a" and, with nothing left, takes the document out of its index.
        assert await PollingRelay(outbox, MemoryPublisher()).drain() == 1

    CollectionWithAHookBeforeItsWrite.hooks.append(relay_publishes_meanwhile)
    orders = CollectionWithAHookBeforeItsWrite(db, "orders")
    await outbox.update_with_events(None, orders, {"_id": 1}, {"$set": {"x": 1}}, [Event(type="b")])
    assert not CollectionWithAHookBeforeItsWrite.hooks
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1
    assert [(e.type, e.sequence) for e in publisher.events] == [("b", 2)]


async def test_an_embedded_update_while_a_relay_holds_the_document_is_published_after_it(
    db: Any,
) -> None:
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    store = store_for(outbox)
    claim = await store.claim(10, timedelta(minutes=5))
    (group,) = claim.groups
    await outbox.update_with_events(
        None, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [Event(type="b")]
    )
    # The lease is kept: no other relay takes the document while its claimer publishes.
    assert (await store.claim(10, timedelta(minutes=5))).groups == ()
    await store.settle(claim, list(group), [])
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1
    assert [(e.type, e.sequence) for e in publisher.events] == [("b", 2)]


@pytest.mark.parametrize("write", ["save", "update"])
async def test_a_repeated_write_racing_the_publication_of_its_event_is_refused(
    db: Any, write: str
) -> None:
    # The repeat finds the event's reservation not yet published; the relay publishes the event
    # and removes it from the document before the repeat writes: the repeat must still be refused.
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    event = Event(type="a")
    await outbox.save_with_events(None, db.orders, {"_id": 1, "n": 0}, [event])

    async def relay_publishes_meanwhile() -> None:
        assert await PollingRelay(outbox, MemoryPublisher()).drain() == 1

    CollectionWithAHookBeforeItsWrite.hooks.append(relay_publishes_meanwhile)
    orders = CollectionWithAHookBeforeItsWrite(db, "orders")
    with pytest.raises(DuplicateEventError):
        if write == "save":
            await outbox.save_with_events(None, orders, {"_id": 1, "n": 1}, [event])
        else:
            await outbox.update_with_events(None, orders, {"_id": 1}, {"$inc": {"n": 1}}, [event])
    assert not CollectionWithAHookBeforeItsWrite.hooks
    stored = await db.orders.find_one({"_id": 1})
    assert (stored["n"], stored["_version"], stored["_outbox"]) == (0, 1, [])
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 0


async def test_an_upsert_with_a_stored_version_to_match_inserts_nothing(
    writer: Writer, db: Any
) -> None:
    # expected_version=3 says the aggregate exists at version 3: a missing one is a conflict, not
    # a new aggregate inserted at version 4.
    async def upsert_at_version_3() -> Saved:
        return await writer.update_with_events(
            None,
            db.orders,
            {"_id": "o1"},
            {"$set": {"a": 1}},
            [Event(type="x")],
            upsert=True,
            expected_version=3,
        )

    with pytest.raises(ConcurrencyError):
        await upsert_at_version_3()
    assert await contents(db) == {}
    await db.orders.insert_one({"_id": "o1", "_version": 3, "_sequence": 2})
    saved = await upsert_at_version_3()
    assert (saved.version, saved.events[0].sequence) == (4, 3)


@pytest.mark.parametrize(
    "query",
    [
        {"_id": "o1", "_version": 5},
        {"_id": "o1", "_sequence": 40},
        {"_id": "o1", "$and": [{"_version": 5}]},
        {"_id": "o1", "$or": [{"_sequence.x": 1}]},
    ],
)
async def test_an_upsert_filter_may_not_name_an_owned_field(
    writer: Writer, db: Any, query: dict[str, Any]
) -> None:
    # An upsert inserts its filter's equalities: the new aggregate would start at version 6, or
    # number its first event 41.
    with pytest.raises(InvalidAggregateError, match="a field the outbox owns"):
        await writer.update_with_events(
            None, db.orders, query, {"$set": {"a": 1}}, [Event(type="x")], upsert=True
        )
    assert await contents(db) == {}
    # Without upsert such a condition only guards the update, as expected_version does.
    await db.orders.insert_one({"_id": "o1", "_version": 5, "_sequence": 40})
    saved = await writer.update_with_events(
        None, db.orders, {"_id": "o1", "_version": 5}, {"$set": {"a": 1}}, [Event(type="x")]
    )
    assert (saved.version, saved.events[0].sequence) == (6, 41)


async def test_array_filters_update_the_elements_they_select(writer: Writer, db: Any) -> None:
    items = [{"sku": "a", "qty": 1}, {"sku": "b", "qty": 1}, {"sku": "b", "qty": 7}]
    await writer.save_with_events(None, db.orders, {"_id": "o1", "items": items}, [])
    saved = await writer.update_with_events(
        None,
        db.orders,
        {"_id": "o1"},
        {"$set": {"items.$[line].qty": 0}},
        [Event(type="sku.b.cancelled")],
        array_filters=[{"line.sku": "b", "line.qty": {"$lt": 5}}],
    )
    assert saved.version == 2
    stored = await db.orders.find_one({"_id": "o1"})
    assert stored["items"] == [
        {"sku": "a", "qty": 1},
        {"sku": "b", "qty": 0},
        {"sku": "b", "qty": 7},
    ]
    assert await pending(writer) == [("sku.b.cancelled", "o1", 1)]
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.relay_outbox, publisher).drain() == 1


@pytest.mark.parametrize(
    ("update", "array_filters", "reason"),
    [
        ([{"$set": {"x": 1}}], [{"i.sku": "a"}], "not to a pipeline"),
        ({"$set": {"items.$[i].qty": 0}}, {"i.sku": "a"}, "must be a list"),
        ({"$set": {"items.$[i].qty": 0}}, [{}], "non-empty filter document"),
        ({"$set": {"items.$[i].qty": 0}}, ["i.sku"], "non-empty filter document"),
    ],
)
async def test_bad_array_filters_are_refused_before_anything_is_written(
    writer: Writer, db: Any, update: Any, array_filters: Any, reason: str
) -> None:
    await writer.save_with_events(None, db.orders, {"_id": "o1", "items": [{"sku": "a"}]}, [])
    before = await db.orders.find_one({"_id": "o1"})
    with pytest.raises(InvalidAggregateError, match=reason):
        await writer.update_with_events(
            None, db.orders, {"_id": "o1"}, update, [Event(type="x")], array_filters=array_filters
        )
    assert await db.orders.find_one({"_id": "o1"}) == before
    assert await pending(writer) == []


async def test_an_array_filter_no_identifier_uses_is_mongodbs_refusal(
    writer: Writer, db: Any
) -> None:
    await writer.save_with_events(None, db.orders, {"_id": "o1", "items": [{"sku": "a"}]}, [])
    with pytest.raises(InvalidAggregateError):
        await writer.update_with_events(
            None,
            db.orders,
            {"_id": "o1"},
            {"$set": {"items.$[i].qty": 0}},
            [Event(type="x")],
            array_filters=[{"i.sku": "a"}, {"unused.sku": "b"}],
        )
    assert await pending(writer) == []
