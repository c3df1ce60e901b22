"""One event id, one event: a reused id is refused in both modes, pending or recently published.

The broker deduplicates on the event id, so a second event under an id already sent would be
dropped by the broker and marked published by the relay: lost without a word.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

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
from tests.support.contents import contents
from tests.support.outboxes import MODES, make_outbox


@pytest.mark.parametrize("mode", MODES)
async def test_an_event_id_pending_in_another_document_is_refused_and_nothing_is_written(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    event = Event(type="placed")
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
    assert await contents(db) == before
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1


@pytest.mark.parametrize("mode", MODES)
async def test_an_event_id_published_within_retention_is_refused_for_another_document(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    event = Event(type="placed")
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
    event = Event(type="placed")
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
    late = Event(type="late")
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
    taken = Event(type="taken")
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
    event = Event(type="placed")
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
    event = Event(type="placed")
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
    event = Event(type="a")
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
    await outbox.save_with_events(None, db.orders, {"_id": 2}, [event])


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
