"""A relay run through a broker outage (the broker killed or gated mid-run by a
``KillsTheBroker`` publisher), shared by the NATS, RabbitMQ and Redis outage tests."""

from __future__ import annotations

import asyncio
from typing import Any

from mongo_outbox import Backoff, ChangeStreamRelay, Event, Outbox, PollingRelay, RelaySettings
from tests.support.brokers import KillsTheBroker

FAST = Backoff(initial=0.05, maximum=0.3)
SETTINGS = RelaySettings(
    batch_size=10, claim_lease=2.0, publish_timeout=1.0, backoff=FAST, max_attempts=2
)


async def save_steps(outbox: Outbox, db: Any) -> list[Event]:
    """Four saves of each of ten orders, one event each, interleaved across orders."""
    saved: list[Event] = []
    for step in range(4):
        for order in range(10):
            result = await outbox.save_with_events(
                None, db.orders, {"_id": order, "step": step}, [Event(type="step")]
            )
            saved += result.events
    return saved


async def relay_through_outage(db: Any, publisher: KillsTheBroker, relay_kind: str) -> list[Event]:
    """Relay saved events through the outage until every one is published; check that the
    outage happened, made publishes fail, and parked nothing. Returns the saved events.

    The polling relay drains a collection-mode outbox saved beforehand. The change-stream
    relay follows the server's own stream (the emulator's through the test shim, or a replica
    set's) while the events are saved, in embedded mode (the other mode of the two)."""
    relay: PollingRelay | ChangeStreamRelay
    if relay_kind == "polling":
        outbox = Outbox(db)
        await outbox.ensure_indexes()
        saved = await save_steps(outbox, db)
        relay = PollingRelay(
            outbox,
            publisher,
            settings=SETTINGS,
            interval=0.05,
        )
        task = asyncio.create_task(relay.run())
    else:
        outbox = Outbox(db, mode="embedded", collections=["orders"])
        await outbox.ensure_indexes()
        relay = ChangeStreamRelay(
            outbox,
            publisher,
            name="orders-relay",
            settings=SETTINGS,
            sweep_interval=0.2,
        )
        task = asyncio.create_task(relay.run())
        while not (await relay.status()).active:  # noqa: ASYNC110 - polling the database
            await asyncio.sleep(0.02)
        saved = await save_steps(outbox, db)

    async def pending() -> int:
        if isinstance(relay, ChangeStreamRelay):
            return (await relay.status()).pending
        return int(await db.outbox.count_documents({"status": {"$ne": "published"}}))

    async def everything_published() -> None:
        while await pending():  # noqa: ASYNC110 - polling the database, no event to wait on
            await asyncio.sleep(0.1)

    await asyncio.wait_for(everything_published(), 60)
    relay.stop()
    await asyncio.wait_for(task, 10)
    assert publisher.restarted is not None  # the broker really went away mid-run
    await publisher.restarted
    if isinstance(relay, PollingRelay):
        assert relay.stats.failed > 0
    else:
        assert (await relay.status()).publish_failures > 0
        assert (await db.outbox_relays.find_one({"_id": "orders-relay"}))["token"] is not None
    assert await relay.parked() == []
    return saved
