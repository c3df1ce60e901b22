"""One event id, one event: a reused id is refused in both modes, pending or recently published.

The broker deduplicates on the event id, so a second event under an id already sent would be
dropped by the broker and marked published by the relay: lost without a word.

Most tests here reuse an id the caller chose (``chosen``): in embedded mode those are the ids a
save reserves in the registry. An id the library made is not reserved at save time
(``_write/event_ids.py``); its own tests are at the end.
"""

from __future__ import annotations

import asyncio
import pickle
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from pymongo import MongoClient, monitoring

from mongo_outbox import (
    ConcurrencyError,
    DuplicateEventError,
    Event,
    Outbox,
    PollingRelay,
    RelaySettings,
)
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher
from tests.support.apis import APIS, Writer
from tests.support.cancelling import CancelsAtCommand
from tests.support.contents import contents
from tests.support.outboxes import MODES, make_outbox, unsettled


def chosen(type: str) -> Event:
    """An event whose id the caller chose, as an idempotency key would be."""
    return Event(id=f"{type}-{uuid.uuid4().hex}", type=type)


@pytest.mark.parametrize("mode", MODES)
async def test_an_event_id_pending_in_another_document_is_refused_and_nothing_is_written(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    event = chosen("placed")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    before = await contents(db)
    for expected_version in (None, 0):
        with pytest.raises(DuplicateEventError) as caught:
            await outbox.save_with_events(
                None,
                db.orders,
                {"_id": 2},
                [Event(type="fresh"), event],
                expected_version=expected_version,
            )
        assert caught.value.collection == "orders"
        assert caught.value.event_id == event.id  # said by the registry, or by the server
        assert event.id in str(caught.value)
        assert "full error" not in str(caught.value)  # no driver dump
    assert await contents(db) == before
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1


@pytest.mark.parametrize("mode", MODES)
async def test_an_event_id_published_within_retention_is_refused_for_another_document(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    event = chosen("placed")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 1  # embedded: pruned now
    before = await contents(db)
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(None, db.orders, {"_id": 2}, [event])
    assert await contents(db) == before


async def test_a_save_retried_after_a_crash_between_reservation_and_write_goes_on(
    db: Any,
) -> None:
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    event = chosen("placed")
    # What a save that crashed after reserving its id, before its document write, left behind.
    await outbox.event_ids.insert_one(
        {
            "_id": event.id,
            "collection": "orders",
            "aggregate": 7,
            "expire_at": utc_now() + timedelta(days=7),
        }
    )
    saved = await outbox.save_with_events(None, db.orders, {"_id": 7}, [event])
    assert [e.sequence for e in saved.events] == [1]
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1
    assert [(e.id, e.aggregate_id) for e in publisher.events] == [(event.id, 7)]
    # The reservation still guards the id against other documents.
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(None, db.orders, {"_id": 8}, [event])


async def test_a_save_repeated_while_its_event_is_pending_is_refused(db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    event = Event(type="placed")
    await outbox.save_with_events(None, db.orders, {"_id": 1, "n": 1}, [event])
    before = await contents(db)
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(None, db.orders, {"_id": 1, "n": 2}, [event])
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(
            None, db.orders, {"_id": 1, "n": 2}, [event], expected_version=1
        )
    assert await contents(db) == before


async def test_a_refused_embedded_save_takes_its_reservations_back(db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    before = await contents(db)
    late = chosen("late")
    with pytest.raises(ConcurrencyError):
        await outbox.save_with_events(None, db.orders, {"_id": 1}, [late], expected_version=5)
    with pytest.raises(ConcurrencyError):
        await outbox.save_with_events(None, db.orders, {"_id": 1}, [late], expected_version=0)
    assert await contents(db) == before
    # The id is free again, for any document.
    await outbox.save_with_events(None, db.orders, {"_id": 2}, [late])


async def test_an_embedded_save_in_a_transaction_reserves_in_it(client: Any, db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    taken = chosen("taken")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [taken])
    before = await contents(db)
    async with client.start_session() as session:
        with pytest.raises(DuplicateEventError):
            async with await session.start_transaction():
                await outbox.save_with_events(session, db.orders, {"_id": 2}, [taken])
        with pytest.raises(RuntimeError):
            async with await session.start_transaction():
                await outbox.save_with_events(session, db.orders, {"_id": 3}, [Event(type="x")])
                raise RuntimeError("abort on purpose")
    assert await contents(db) == before


async def prune_as_the_ttl_monitor_would(outbox: Outbox, after: timedelta) -> None:
    """Delete what the registry's TTL index deletes once ``after`` has passed from now."""
    await outbox.event_ids.delete_many({"expire_at": {"$lte": utc_now() + after}})


async def test_a_pending_id_stays_reserved_past_retention(db: Any) -> None:
    # The relay is down (or the entry parked) for longer than retention: the entry is still
    # pending, so its id must stay its own.
    outbox = Outbox(db, mode="embedded", collections=["orders"], retention=timedelta(hours=1))
    await outbox.ensure_indexes()
    event = chosen("placed")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    await prune_as_the_ttl_monitor_would(outbox, after=timedelta(days=30))
    before = await contents(db)
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(None, db.orders, {"_id": 2}, [event])
    with pytest.raises(DuplicateEventError):
        await outbox.update_with_events(
            None, db.orders, {"_id": 3}, {"$set": {"a": 1}}, [event], upsert=True
        )
    assert await contents(db) == before


async def test_a_parked_id_stays_reserved_past_retention(db: Any) -> None:
    outbox = Outbox(db, mode="embedded", collections=["orders"], retention=timedelta(hours=1))
    await outbox.ensure_indexes()
    event = chosen("placed")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    refusing = MemoryPublisher(fail=lambda e: RuntimeError("refused"))
    relay = PollingRelay(outbox, refusing, settings=RelaySettings(max_attempts=1))
    await relay.drain()
    assert [e["_id"] for e in await relay.parked()] == [event.id]
    await prune_as_the_ttl_monitor_would(outbox, after=timedelta(days=30))
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(None, db.orders, {"_id": 2}, [event])


@pytest.mark.parametrize("api", APIS)
async def test_an_id_published_and_pruned_is_refused_in_its_own_document_too(
    db: Any, sync_client: Any, api: str
) -> None:
    writer = Writer(api, db, sync_client, mode="embedded", collections=["orders"])
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    await outbox.ensure_indexes()
    event = Event(type="placed")
    await writer.save_with_events(None, db.orders, {"_id": 1, "n": 1}, [event])
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 1  # pruned from the document
    before = await contents(db)
    with pytest.raises(DuplicateEventError) as caught:
        await writer.save_with_events(None, db.orders, {"_id": 1, "n": 2}, [event])
    assert "published" in str(caught.value)
    with pytest.raises(DuplicateEventError):
        await writer.update_with_events(None, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [event])
    with pytest.raises(DuplicateEventError):
        await writer.save_with_events(
            None, db.orders, {"_id": 1}, [Event(type="fresh"), event], expected_version=1
        )
    assert await contents(db) == before
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 0


async def test_a_reservation_expires_retention_after_its_event_was_published(db: Any) -> None:
    outbox = Outbox(db, mode="embedded", collections=["orders"], retention=timedelta(hours=1))
    await outbox.ensure_indexes()
    indexes = await outbox.event_ids.index_information()
    assert indexes["ttl"]["key"] == [("expire_at", 1)]
    assert indexes["ttl"]["expireAfterSeconds"] == 0
    event = chosen("a")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    reservation = await outbox.event_ids.find_one({"_id": event.id})
    assert reservation == {"_id": event.id, "collection": "orders", "aggregate": 1}
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 1
    reservation = await outbox.event_ids.find_one({"_id": event.id})
    assert reservation is not None and reservation["published"] is True
    left = reservation["expire_at"] - utc_now()
    assert timedelta(minutes=59) < left <= timedelta(hours=1)
    # Once retention has passed, the id is free again, as in collection mode.
    await prune_as_the_ttl_monitor_would(outbox, after=timedelta(hours=2))
    await outbox.save_with_events(None, db.orders, {"_id": 2}, [Event(id=event.id, type="a")])


async def test_the_relay_takes_an_id_whose_reservation_is_missing_when_it_publishes(
    db: Any,
) -> None:
    # A reservation pruned under the older rule (expiry from the save) or removed by hand.
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    event = Event(type="placed")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    await outbox.event_ids.delete_many({})
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 1
    reservation = await outbox.event_ids.find_one({"_id": event.id})
    assert reservation is not None
    assert (reservation["collection"], reservation["aggregate"], reservation["published"]) == (
        "orders",
        1,
        True,
    )
    with pytest.raises(DuplicateEventError):
        await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])


# Ids the library made: no registry write at save time (_write/event_ids.py).


class Commands(monitoring.CommandListener):
    """A command listener: the names of the commands a client sent."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def started(self, event: Any) -> None:
        self.names.append(event.command_name)

    def succeeded(self, event: Any) -> None:
        pass

    def failed(self, event: Any) -> None:
        pass


async def test_a_save_of_new_events_is_one_command_and_the_relay_takes_their_ids(
    mongo: Any, db: Any
) -> None:
    from pymongo import AsyncMongoClient

    commands = Commands()
    client: Any = AsyncMongoClient(mongo.uri, tz_aware=True, event_listeners=[commands])
    try:
        mine = client[db.name]
        outbox = Outbox(mine, mode="embedded", collections=["orders"])
        await outbox.ensure_indexes()
        await outbox.save_with_events(None, mine.orders, {"_id": 0}, [Event(type="warm")])
        writes = [
            outbox.save_with_events(
                None, mine.orders, {"_id": 1}, [Event(type="a")], expected_version=0
            ),
            outbox.save_with_events(None, mine.orders, {"_id": 1, "n": 1}, [Event(type="b")]),
            outbox.update_with_events(
                None,
                mine.orders,
                {"_id": 1},
                {"$inc": {"n": 1}},
                [Event(type="c"), Event(type="d")],
            ),
        ]
        for write in writes:
            commands.names.clear()
            await write
            assert len(commands.names) == 1, commands.names
    finally:
        await client.close()
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    assert await outbox.event_ids.count_documents({}) == 0
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 5
    taken = await outbox.event_ids.find().to_list(None)
    assert {(t["_id"], t["aggregate"], t["published"]) for t in taken} == {
        (e.id, e.aggregate_id, True) for e in publisher.events
    }


@pytest.mark.parametrize("api", APIS)
async def test_an_event_object_saved_once_is_refused_for_another_document(
    db: Any, sync_client: Any, api: str
) -> None:
    writer = Writer(api, db, sync_client, mode="embedded", collections=["orders"])
    await writer.relay_outbox.ensure_indexes()
    event = Event(type="placed")
    await writer.save_with_events(None, db.orders, {"_id": 1}, [event])
    before = await contents(db)
    copies = [event, event.model_copy(update={"headers": {"k": "v"}})]
    for copy in copies:
        with pytest.raises(DuplicateEventError, match=r"given to a save of .*orders 1"):
            await writer.save_with_events(None, db.orders, {"_id": 2}, [Event(type="x"), copy])
        with pytest.raises(DuplicateEventError):
            await writer.update_with_events(
                None, db.orders, {"_id": 3}, {"$set": {"a": 1}}, [copy], upsert=True
            )
    assert await contents(db) == before
    publisher = MemoryPublisher()
    assert await PollingRelay(writer.relay_outbox, publisher).drain() == 1


async def test_one_event_object_saved_to_two_documents_at_once_goes_to_one(db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    event = Event(type="placed")
    results = await asyncio.gather(
        *(outbox.save_with_events(None, db.orders, {"_id": n}, [event]) for n in range(2)),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, DuplicateEventError)]
    assert len(refused) == 1 and len(results) == 2
    assert await db.orders.count_documents({}) == 1
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1
    assert [e.id for e in publisher.events] == [event.id]


def test_one_event_object_saved_to_two_documents_from_two_threads_goes_to_one(
    sync_client: MongoClient[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sync API in a threaded server: each thread checks the object's marks, then sets them.
    # The check is slowed down here so that, were the two steps not one, both threads would
    # pass it before either set the marks.
    from mongo_outbox._write import event_ids as _event_ids
    from mongo_outbox.sync import Outbox as SyncOutbox

    checked = _event_ids.to_reserve

    def slow(*args: Any) -> list[str]:
        ids = checked(*args)
        time.sleep(0.05)
        return ids

    monkeypatch.setattr(_event_ids, "to_reserve", slow)
    shop = sync_client[f"t_{uuid.uuid4().hex[:12]}"]
    try:
        outbox = SyncOutbox(shop, mode="embedded", collections=["orders"])
        event = Event(type="placed")
        with ThreadPoolExecutor(2) as pool:
            saves = [
                pool.submit(outbox.save_with_events, None, shop.orders, {"_id": n}, [event])
                for n in range(2)
            ]
        failures = [save.exception() for save in saves]
        assert sum(isinstance(f, DuplicateEventError) for f in failures) == 1, failures
        assert shop.orders.count_documents({}) == 1
    finally:
        sync_client.drop_database(shop.name)


async def test_a_save_cancelled_while_reserving_forgets_then_not_later(mongo: Any) -> None:
    # The cancelled save's cleanup (the object is free again) must run when it is cancelled: run
    # when its generator is collected, it would undo the marks of the retry that saved it since.
    import gc

    from pymongo import AsyncMongoClient

    canceller = CancelsAtCommand("find", naming="_event_ids")  # the registry's read
    client: Any = AsyncMongoClient(mongo.uri, event_listeners=[canceller])
    db = client[f"t_{uuid.uuid4().hex[:12]}"]
    try:
        outbox = Outbox(db, mode="embedded", collections=["carts"])
        event = Event(type="cart.created")
        async with client.start_session() as session:
            await session.start_transaction()  # in a transaction every id is reserved
            save = asyncio.create_task(
                outbox.save_with_events(session, db.carts, {"_id": "A"}, [event])
            )
            canceller.task = save
            with pytest.raises(asyncio.CancelledError):
                await save
            assert not session.in_transaction  # the save aborted the transaction it joined
        await outbox.save_with_events(None, db.carts, {"_id": "A"}, [event])
        del save
        gc.collect()
        with pytest.raises(DuplicateEventError, match="one event, one document"):
            await outbox.save_with_events(None, db.carts, {"_id": "B"}, [event])
        assert [d["_id"] async for d in db.carts.find({"_outbox.id": event.id})] == ["A"]
    finally:
        await client.drop_database(db.name)
        await client.close()


async def test_a_refused_save_of_a_new_event_leaves_it_free_for_another_document(
    db: Any,
) -> None:
    outbox = make_outbox(db, "embedded")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    late = Event(type="late")
    with pytest.raises(ConcurrencyError):
        await outbox.save_with_events(None, db.orders, {"_id": 1}, [late], expected_version=5)
    saved = await outbox.save_with_events(None, db.orders, {"_id": 2}, [late])
    assert [e.id for e in saved.events] == [late.id]
    assert saved.events[0] == late.model_copy(
        update=saved.events[0].model_dump(include={"aggregate_type", "aggregate_id", "sequence"})
    )


async def test_a_new_event_saved_in_a_transaction_is_reserved_in_it(client: Any, db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    event = Event(type="placed")
    async with client.start_session() as session:
        async with await session.start_transaction():
            await outbox.save_with_events(session, db.orders, {"_id": 1}, [event])
    reservation = await outbox.event_ids.find_one({"_id": event.id})
    assert reservation == {"_id": event.id, "collection": "orders", "aggregate": 1}


async def test_a_library_made_id_copied_into_another_document_is_parked_not_dropped(
    db: Any,
) -> None:
    # A hostile caller copies an id the library made, still pending (so not in the registry),
    # into an event of another document: the save cannot know, the relay must not drop one.
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    original = Event(type="placed")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [original])
    await outbox.save_with_events(
        None, db.orders, {"_id": 2}, [Event(id=original.id, type="copy"), Event(type="after")]
    )
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == 2
    parked = await relay.parked()
    assert [p["_id"] for p in parked] == [original.id]
    assert "is taken by orders" in parked[0]["last_error"]
    published = {(e.id, e.type) for e in publisher.events}
    assert len({i for i, _ in published}) == 2 and (original.id, parked[0]["type"]) not in published
    assert len(await unsettled(outbox, db)) == 1  # the parked one, kept, not lost


class DrainAfterReserving:
    """The registry, but a relay drains right after a save's reservation insert: a retry of a
    save that races its own event out."""

    def __init__(self, inner: Any, relay: PollingRelay) -> None:
        self.inner, self.relay = inner, relay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def insert_many(self, *args: Any, **kwargs: Any) -> Any:
        result = await self.inner.insert_many(*args, **kwargs)
        await self.relay.drain()
        return result


async def test_a_retry_refused_after_its_event_went_out_keeps_the_id_taken(db: Any) -> None:
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    event = Event(type="placed")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    registry = outbox._registry.registry
    outbox._registry.registry = DrainAfterReserving(registry, relay)
    try:
        with pytest.raises(DuplicateEventError):  # it went out between reserving and writing
            await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    finally:
        outbox._registry.registry = registry
    [taken] = await outbox.event_ids.find().to_list(None)
    assert (taken["_id"], taken["aggregate"], taken["published"]) == (event.id, 1, True)
    # Another event of the document goes out (the just-sent ids are forgotten): still taken.
    await outbox.update_with_events(
        None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [Event(type="b")]
    )
    assert await relay.drain() == 1
    for order in (1, 2):
        with pytest.raises(DuplicateEventError):
            await outbox.save_with_events(
                None, db.orders, {"_id": order}, [Event(id=event.id, type="c")]
            )
    assert [e.id for e in publisher.events].count(event.id) == 1


async def test_a_new_event_saved_in_a_transaction_is_refused_again_once_published(
    client: Any, db: Any
) -> None:
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    event = Event(type="placed")
    async with client.start_session() as session:
        async with await session.start_transaction():
            await outbox.save_with_events(session, db.orders, {"_id": 1}, [event])
    relay = PollingRelay(outbox, MemoryPublisher())
    assert await relay.drain() == 1
    await outbox.update_with_events(
        None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [Event(type="b")]
    )
    assert await relay.drain() == 1
    with pytest.raises(DuplicateEventError, match="published"):
        await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])


async def test_a_copy_made_before_the_save_is_parked_not_dropped_once_its_id_went_out(
    db: Any,
) -> None:
    # A copy taken before the first save remembers nothing; changed and saved to the same
    # document after the event went out, it would be dropped by the broker as a duplicate.
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    event = Event(type="placed", payload={"v": 1})
    changed = event.model_copy(update={"payload": {"v": 2}})
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == 1
    await outbox.update_with_events(
        None, db.orders, {"_id": 1}, {"$set": {"x": 1}}, [Event(type="b")]
    )
    assert await relay.drain() == 1  # and the document forgets the ids it just sent
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [changed])
    assert await relay.drain() == 0
    [parked] = await relay.parked()
    assert (parked["_id"], parked["payload"]) == (event.id, {"v": 2})
    assert "taken by event 1 of orders 1" in parked["last_error"]
    assert [(e.id, e.payload) for e in publisher.events if e.id == event.id] == [
        (event.id, {"v": 1})
    ]


async def test_copies_saved_into_the_same_document_while_pending_go_out_once_the_rest_parked(
    db: Any,
) -> None:
    # Copies taken before the first save, changed, saved into the same document while the
    # event is still pending: the document holds one id three times. One goes out (the first,
    # which takes the id); the others are parked where they are, kept whole, not dropped by
    # the broker as its duplicates, and not removed when the first is settled.
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    event = Event(type="placed", payload={"v": 1})
    copies = [event.model_copy(update={"payload": {"v": n}}) for n in (2, 3)]
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    for copy in copies:  # (in one save, a repeated id is refused before anything is written)
        await outbox.update_with_events(None, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [copy])
    later = Event(type="after")
    await outbox.update_with_events(None, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [later])
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == 2
    assert [(e.id, e.payload, e.sequence) for e in publisher.events] == [
        (event.id, {"v": 1}, 1),
        (later.id, {}, 4),
    ]
    parked = await relay.parked()
    assert sorted((p["_id"], p["payload"]["v"], p["sequence"]) for p in parked) == [
        (event.id, 2, 2),
        (event.id, 3, 3),
    ]
    assert all("taken by event 1 of orders 1" in p["last_error"] for p in parked)
    assert len(await unsettled(outbox, db)) == 2  # both kept, none lost
    assert await relay.drain() == 0


class WhilePublishing(MemoryPublisher):
    """A publisher that runs ``meanwhile`` once, while the relay holds the document, as it
    publishes ``event_id`` for the first time."""

    def __init__(self, event_id: str, meanwhile: Any) -> None:
        super().__init__()
        self.event_id, self.meanwhile = event_id, meanwhile

    async def publish(self, event: Event) -> None:
        if event.id == self.event_id and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            await meanwhile()
        await super().publish(event)


@pytest.mark.parametrize("how", ["saved", "requeued"])
async def test_a_copy_that_joins_the_document_while_its_original_is_published_is_kept(
    db: Any, how: str
) -> None:
    # While the relay holds the document and publishes the original, a copy of it (same id,
    # another payload) is saved into it, or the parked copy is requeued there. Settling the
    # original removes the original's entry only: the copy stays, and the next claim parks it.
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    event = Event(type="placed", payload={"v": 1})
    copy = event.model_copy(update={"payload": {"v": 2}})
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    relay = PollingRelay(outbox, MemoryPublisher())
    if how == "requeued":
        await outbox.update_with_events(None, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [copy])
        # The original fails once (to be retried), the copy is parked as taken.
        down = MemoryPublisher(fail=lambda e: RuntimeError("down"))
        await PollingRelay(outbox, down).drain()
        assert [p["payload"] for p in await relay.parked()] == [{"v": 2}]
        await db.orders.update_one({"_id": 1}, {"$set": {"_outbox_due": utc_now()}})

    async def meanwhile() -> None:
        if how == "saved":
            await outbox.update_with_events(None, db.orders, {"_id": 1}, {"$inc": {"n": 1}}, [copy])
        else:
            assert await relay.requeue([copy.id]) == 1

    publisher = WhilePublishing(event.id, meanwhile)
    assert await PollingRelay(outbox, publisher).drain() == 1
    assert [(e.id, e.payload) for e in publisher.events] == [(event.id, {"v": 1})]
    assert await PollingRelay(outbox, publisher).drain() == 0  # its next round: the copy
    [parked] = await relay.parked()
    assert (parked["_id"], parked["payload"]) == (event.id, {"v": 2})
    assert "taken by event 1 of orders 1" in parked["last_error"]
    assert len(await unsettled(outbox, db)) == 1  # kept, not removed with the original


def test_an_event_pickled_by_an_older_version_saves_as_a_new_one() -> None:
    event = Event(type="placed")
    state = dict(event.__getstate__()) | {"__pydantic_private__": None}
    old = Event.__new__(Event)
    old.__setstate__(state)
    assert old == event and old._home is None and not old._given
    assert pickle.loads(pickle.dumps(old)) == event
