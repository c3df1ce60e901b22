"""During a broker outage the relay probes once a second, whatever its backoff: a short backoff
must not turn every waiting event into a retry loop (docs/failures.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mongo_outbox import (
    Backoff,
    BrokerUnavailableError,
    ChangeStreamRelay,
    Event,
    Outbox,
    PollingRelay,
    RelayGroup,
)
from mongo_outbox._relay.store import store_for
from mongo_outbox.publishers import MemoryPublisher, Publisher, RabbitMQPublisher
from mongo_outbox.settings import RelaySettings
from tests.support.brokers import FaultyGate
from tests.support.messages import bind_queue
from tests.support.waiting import until


@pytest.mark.slow
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


class Counting:
    """Publishes through ``inner`` (a real publisher), counting attempts and confirms."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.tries = 0
        self.confirmed: set[str] = set()

    async def publish(self, event: Event) -> None:
        self.tries += 1
        await self.inner.publish(event)
        self.confirmed.add(event.id)

    async def aclose(self) -> None:
        await self.inner.aclose()


WINDOW = 3.0
EVENTS = 6
TINY = RelaySettings(
    backoff=Backoff(initial=0.01, maximum=0.01), publish_timeout=1.0, claim_lease=2.0
)


async def drain_all(queue: Any) -> list[Any]:
    messages = []
    while (message := await queue.get(fail=False, timeout=5)) is not None:
        await message.ack()
        messages.append(message)
    return messages


def relay_of(kind: str, outbox: Outbox, publisher: Counting) -> tuple[Any, int]:
    """A relay of ``kind`` and how many publishing loops it runs (each may probe)."""
    if kind == "polling":
        return PollingRelay(outbox, publisher, settings=TINY, interval=0.01), 1
    if kind == "changestream":
        return ChangeStreamRelay(outbox, publisher, name="paced", settings=TINY), 1
    group = RelayGroup(outbox, publisher, settings=TINY, member_lease=3.0, interval=0.01)
    return group, outbox.partitions


@pytest.mark.parametrize("how", ["refused", "hanging", "dropping"])
@pytest.mark.parametrize("kind", ["polling", "changestream", "group"])
async def test_no_relay_loops_hot_whichever_way_the_broker_is_down(
    db: Any, channel: Any, unique: str, kind: str, how: str
) -> None:
    """Every relay kind, against the real RabbitMQ behind a gate that refuses connections,
    hangs, or drops each connection mid-publish, with a 10 ms backoff: a handful of probes a
    second, not a retry loop (782 publishes in 3 s for 6 events, once); then it all drains."""
    # Embedded mode for the change stream (saved before it starts anyway); partitions for a group.
    mode = "embedded" if kind == "changestream" else "collection"
    outbox = Outbox(
        db,
        mode=mode,  # type: ignore[arg-type]
        collections=["orders"],
        partitions=2 if kind == "group" else 1,
    )
    await outbox.ensure_indexes()
    for order in range(EVENTS):
        await outbox.save_with_events(None, db.orders, {"_id": order}, [Event(type="placed")])
    queue = await bind_queue(channel, unique)
    gate = FaultyGate()
    await gate.start()
    publisher = Counting(await RabbitMQPublisher.connect(gate.url, exchange=unique, timeout=1.0))
    relay, loops = relay_of(kind, outbox, publisher)
    await gate.fail(how)
    task = asyncio.create_task(relay.run())
    try:
        await asyncio.sleep(WINDOW)  # a rate over a window: nothing to wait for but time
        tried = publisher.tries
        # Each event once at first, then about a probe a second per publishing loop.
        assert tried <= EVENTS + 3 * WINDOW * loops, f"{tried} publish attempts in {WINDOW} s"
        await gate.heal()
        await until(lambda: len(publisher.confirmed) == EVENTS, 60)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 20)
        await publisher.aclose()
        await gate.kill()
    # Published at least once each (a publish dropped mid-way may have reached the queue).
    received = [Event.from_json(m.body).id for m in await drain_all(queue)]
    assert set(received) == publisher.confirmed
    assert await store_for(outbox).parked_count() == 0
