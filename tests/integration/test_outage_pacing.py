"""During a broker outage the relay probes once a second, whatever its backoff: a short backoff
must not turn every waiting event into a retry loop (docs/failures.md)."""

from __future__ import annotations

import asyncio
from typing import Any

from mongo_outbox import Backoff, BrokerUnavailableError, Event, Outbox, PollingRelay
from mongo_outbox.publishers import MemoryPublisher
from mongo_outbox.settings import RelaySettings


async def test_an_outage_is_probed_once_a_second_even_with_a_tiny_backoff(db: Any) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    for order in range(20):
        await outbox.save_with_events(None, db.orders, {"_id": order}, [Event(type="placed")])
    down = True
    tries: list[str] = []

    def fail(event: Event) -> BaseException | None:
        tries.append(event.id)
        return BrokerUnavailableError("connection refused", event_id=event.id) if down else None

    publisher = MemoryPublisher(fail=fail)
    relay = PollingRelay(
        outbox,
        publisher,
        settings=RelaySettings(backoff=Backoff(initial=0.01, maximum=0.02)),
        interval=0.01,
    )
    task = asyncio.create_task(relay.run())
    try:
        await asyncio.sleep(3.5)
        # The first round tries all 20; after it, about one probe a second. Without the floor,
        # each of the 20 would come back every 20 ms: thousands of tries.
        assert 20 <= len(tries) <= 20 + 5, f"{len(tries)} publish attempts in 3.5 s"
        down = False
        await publisher.wait_for(20, timeout=10)  # the broker is back: everything drains
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    assert (await relay.status()).parked == 0
