"""The default configuration under concurrency: collection mode, eight writers committing
transactions side by side (their own and the caller's), while a polling relay, a change-stream
relay or a relay group publishes. Every committed save is published, in order per aggregate,
and nothing else is; and the saves commit as they would on MongoDB (a conflict is retried, never
surfaced as an error or a loss)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mongo_outbox import ChangeStreamRelay, Outbox, PollingRelay, RelayGroup, RelaySettings
from mongo_outbox.publishers import MemoryPublisher
from tests.support.outboxes import assert_in_order, save_aborted
from tests.support.waiting import until
from tests.support.writers import save_concurrently

FAST = RelaySettings(claim_lease=2.0, publish_timeout=0.5)


def relays(kind: str, outbox: Outbox, publisher: MemoryPublisher) -> list[Any]:
    if kind == "polling":
        return [
            PollingRelay(outbox, publisher, settings=FAST),
            PollingRelay(outbox, publisher, settings=FAST),
        ]
    if kind == "changestream":
        return [ChangeStreamRelay(outbox, publisher, name="orders-relay", settings=FAST)]
    return [
        RelayGroup(outbox, publisher, member_lease=3.0, interval=0.05, settings=FAST)
        for _ in range(2)
    ]


@pytest.mark.parametrize("kind", ["polling", "changestream", "group"])
async def test_eight_transactional_writers_beside_running_relays_lose_nothing(
    db: Any, kind: str
) -> None:
    partitions = 4 if kind == "group" else None
    outbox = Outbox(db, partitions=partitions) if partitions else Outbox(db)
    await outbox.ensure_indexes()
    publisher = MemoryPublisher()
    running = relays(kind, outbox, publisher)
    tasks = [asyncio.create_task(relay.run()) for relay in running]
    try:
        aborted = [await save_aborted(outbox, db, 900)]
        committed = await save_concurrently(outbox, db, 160)
        aborted.append(await save_aborted(outbox, db, 901))
        committed_ids = {event.id for event in committed}

        async def all_published() -> bool:
            return committed_ids <= {event.id for event in publisher.events}

        await until(all_published, timeout=60)
    finally:
        for relay in running:
            relay.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert len(committed) == 160
    assert not {event.id for event in publisher.events} & set(aborted)
    assert_in_order(publisher.events, committed, once=False)
    # Each save's own write committed with it, once.
    assert await db.receipts.count_documents({}) == 80
    assert await db.outbox.count_documents({}) == 160
