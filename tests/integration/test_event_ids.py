"""One event id, one event: a reused id is refused in both modes, pending or recently published.

The broker deduplicates on the event id, so a second event under an id already sent would be
dropped by the broker and marked published by the relay: lost without a word.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from mongo_outbox import ConcurrencyError, DuplicateEventError, Event, Outbox, PollingRelay
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher
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


async def test_the_registry_expires_reservations_after_retention(db: Any) -> None:
    outbox = Outbox(db, mode="embedded", collections=["orders"], retention=timedelta(hours=1))
    await outbox.ensure_indexes()
    indexes = await outbox.event_ids.index_information()
    assert indexes["ttl"]["key"] == [("expire_at", 1)]
    assert indexes["ttl"]["expireAfterSeconds"] == 0
    event = Event(type="a")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    reservation = await outbox.event_ids.find_one({"_id": event.id})
    assert reservation is not None
    assert (reservation["collection"], reservation["aggregate"]) == ("orders", 1)
    left = reservation["expire_at"] - utc_now()
    assert timedelta(minutes=59) < left <= timedelta(hours=1)
