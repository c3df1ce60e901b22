"""A relay while a broker or one destination is out, through the real NATS and nats-servers of
the test's own: a backlog drains at full speed once the broker is back, an unroutable event is a
failure of its own while the others are confirmed, and a full destination waits out its own
delay while the others flow."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mongo_outbox import (
    Backoff,
    Event,
    PollingRelay,
    RelaySettings,
)
from mongo_outbox._relay.failures import OUTAGE_WAIT
from mongo_outbox.publishers import MemoryPublisher, NatsPublisher
from tests.support.brokers import Broker, KillsTheBroker
from tests.support.outboxes import make_outbox, save_one_by_one
from tests.support.servers import NATS_URL
from tests.support.waiting import drained, until

FAST = Backoff(initial=0.01, maximum=0.05)


async def test_a_backlog_drains_at_full_speed_once_the_broker_is_back(
    db: Any, broker: Broker, unique: str
) -> None:
    import nats

    nc = await nats.connect(broker.url)
    await nc.jetstream().add_stream(name=unique, subjects=[f"{unique}.>"])
    await nc.close()
    outbox = make_outbox(db, "collection")
    await save_one_by_one(outbox, db, aggregates=20, events=10)
    inner = await NatsPublisher.connect(broker.url, subject=f"{unique}.{{type}}", timeout=0.5)
    publisher = KillsTheBroker(inner, broker, after=10, down_for=5.0)
    # The default claim lease: a round of 100 on a loaded machine's emulator can take longer
    # than a short one allows before its publish (and then publishes nothing).
    relay = PollingRelay(outbox, publisher, settings=RelaySettings(publish_timeout=1))
    task = asyncio.create_task(relay.run())
    # Entries that failed while the broker was away wait OUTAGE_WAIT from their failure unless
    # the relay wakes them once it is back: drained well before that, they were woken.
    woken_by = OUTAGE_WAIT - publisher.down_for - 5
    try:
        await until(lambda: publisher.back_at is not None, timeout=30)
        while await db.outbox.count_documents({"status": "pending"}):
            assert publisher.back_at is not None
            elapsed = asyncio.get_running_loop().time() - publisher.back_at
            assert elapsed < woken_by, (
                f"the backlog is still draining {woken_by:g} s after the broker came back"
            )
            await asyncio.sleep(0.1)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
        await publisher.aclose()
    assert relay.stats.failed > 0 and await relay.parked() == []


async def test_an_unroutable_event_becomes_its_own_failure_while_others_are_confirmed(
    db: Any, nats_stream: str
) -> None:
    # Embedded mode: saves beside a running relay need no transaction (see docs/testing.md).
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    [lost] = (
        await outbox.save_with_events(None, db.orders, {"_id": "x"}, [Event(type="lost")])
    ).events
    # Only ok.* subjects have a stream: the lost event has nowhere to go, the others do.
    subject = lambda e: f"{nats_stream}.ok" if e.type == "ok" else f"nowhere-{nats_stream}"  # noqa: E731
    publisher = await NatsPublisher.connect(NATS_URL, subject=subject, timeout=0.5)
    relay = PollingRelay(
        outbox, publisher, settings=RelaySettings(max_attempts=3, backoff=FAST), interval=0.02
    )
    task = asyncio.create_task(relay.run())
    try:
        for order in range(200):  # a steady flow of routable events meanwhile
            await outbox.save_with_events(None, db.orders, {"_id": order}, [Event(type="ok")])
            if await relay.parked():
                break
            await asyncio.sleep(0.05)
        [parked] = await relay.parked()
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
        await publisher.aclose()
    assert parked["_id"] == lost.id and parked["attempts"] == 3
    assert isinstance(parked["last_error"], str) and parked["last_error"]
    # Its retries were spaced by its own growing delay, not three a second for ever.
    assert relay.stats.errors_by_type.get("BrokerUnavailableError", 0) < 40


@pytest.mark.slow
async def test_a_full_destination_waits_its_own_delay_while_others_flow(db: Any) -> None:
    from mongo_outbox import BrokerFullError

    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    [full] = (
        await outbox.save_with_events(None, db.orders, {"_id": "x"}, [Event(type="full")])
    ).events

    def fail(event: Event) -> BaseException | None:
        if event.type == "full":
            return BrokerFullError("queue full (reject-publish)", event_id=event.id)
        return None

    publisher = MemoryPublisher(fail=fail)
    # A delay drawn from [0, 300 s), then [0, 600 s): a second try within the few seconds of
    # this test is a 1-in-30 chance even on a slow machine, a third one about 1 in 2,000.
    slow_retry = RelaySettings(backoff=Backoff(initial=300, maximum=3000))
    relay = PollingRelay(outbox, publisher, settings=slow_retry, interval=0.02)
    task = asyncio.create_task(relay.run())
    for order in range(30):  # three seconds of other traffic, confirmed every round
        await outbox.save_with_events(None, db.orders, {"_id": order}, [Event(type="ok")])
        await asyncio.sleep(0.1)

    async def unpublished() -> int:
        return 30 - len(publisher.events)

    await drained(unpublished)  # the last saves' round may still be under way
    relay.stop()
    await asyncio.wait_for(task, 10)
    # Tried once, or twice if the random delay was short: not woken each second with the rest
    # (which would try it 30 times).
    assert relay.stats.errors_by_type["BrokerFullError"] <= 2
    assert await relay.parked() == [] and len(publisher.events) == 30
    assert full.id not in {e.id for e in publisher.events}
