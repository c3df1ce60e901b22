"""Every relay kind, and every documented ``mongo-outbox`` invocation, works at its defaults:
built with nothing but what it cannot do without, each publishes to the real RabbitMQ (the
default exchange ``events``, routing key ``{type}``) and stops cleanly. A default that
contradicts another (a group member's lease shorter than 2.5 publish timeouts, say) fails here
first."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Any

import pytest

from mongo_outbox import (
    ChangeStreamRelay,
    Event,
    Outbox,
    PollingRelay,
    RelayGroup,
)
from mongo_outbox.publishers import RabbitMQPublisher
from mongo_outbox.tenants import TenantRelays
from tests.support.cli import Service, cli
from tests.support.servers import RABBITMQ_URL, MongoServer
from tests.support.waiting import until

Relay = PollingRelay | ChangeStreamRelay | RelayGroup | TenantRelays


@pytest.fixture
async def queue(channel: Any, unique: str) -> Any:
    """A queue of the test's own on the default exchange, for events of type ``unique``."""
    import aio_pika

    exchange = await channel.declare_exchange("events", aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(unique, exclusive=True)
    await queue.bind(exchange, unique)
    return queue


async def arrived(queue: Any, events: list[Event]) -> None:
    """Wait until every one of ``events`` is in ``queue``."""
    seen: set[str] = set()

    async def all_there() -> bool:
        while (message := await queue.get(fail=False)) is not None:
            await message.ack()
            seen.add(str(message.message_id))
        return seen >= {e.id for e in events}

    await until(all_there, timeout=30, every=0.1)


async def save(outbox: Outbox, unique: str, n: int = 2) -> list[Event]:
    events: list[Event] = []
    for i in range(n):
        saved = await outbox.save_with_events(
            None, outbox.db.orders, {"_id": f"o-{i}"}, [Event(type=unique)]
        )
        events += saved.events
    return events


KINDS: dict[str, Callable[[list[Outbox], Any], Relay]] = {
    "polling": lambda outboxes, publisher: PollingRelay(outboxes[0], publisher),
    "changestream": lambda outboxes, publisher: ChangeStreamRelay(
        outboxes[0], publisher, name="orders"
    ),
    "group-polling": lambda outboxes, publisher: RelayGroup(
        outboxes[0], publisher, name="orders", source="polling"
    ),
    "group-changestream": lambda outboxes, publisher: RelayGroup(
        outboxes[0], publisher, name="orders"
    ),
    "tenants": lambda outboxes, publisher: TenantRelays(
        [ChangeStreamRelay(outbox, publisher, name="orders") for outbox in outboxes]
    ),
}


@pytest.mark.parametrize("kind", list(KINDS))
async def test_every_relay_kind_runs_at_its_defaults(
    client: Any, db: Any, queue: Any, unique: str, kind: str
) -> None:
    partitions = {"partitions": 4} if kind.startswith("group") else {}
    other = client[f"{db.name}_b"]
    outboxes = [Outbox(db, **partitions)]  # type: ignore[arg-type]
    if kind == "tenants":
        outboxes.append(Outbox(other))
    for outbox in outboxes:
        await outbox.ensure_indexes()
    # Saved before the relay starts, which finds them at once: the test MongoDB mishandles
    # transactions concurrent with the relay's writes (docs/testing.md).
    events = [e for outbox in outboxes for e in await save(outbox, unique)]
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL)
    relay = KINDS[kind](outboxes, publisher)
    task = asyncio.ensure_future(relay.run())
    try:
        await arrived(queue, events)
        relay.stop()
        await asyncio.wait_for(task, 30)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await publisher.aclose()
        await client.drop_database(other.name)


RELAYS = {
    "change stream": [],
    "polling": ["--polling"],
    "group member": ["--partitions=4"],
    "polling group member": ["--partitions=4", "--polling"],
    "tenants": ["--databases={db},{db}_b"],
}


@pytest.mark.parametrize("options", list(RELAYS.values()), ids=list(RELAYS))
async def test_every_documented_relay_invocation_runs_at_its_defaults(
    mongo: MongoServer, client: Any, db: Any, queue: Any, unique: str, options: list[str]
) -> None:
    tenants = any(o.startswith("--databases") for o in options)
    partitions = {"partitions": 4} if any(o.startswith("--partitions") for o in options) else {}
    other = client[f"{db.name}_b"]
    outboxes = [Outbox(db, **partitions)]  # type: ignore[arg-type]
    if tenants:
        outboxes.append(Outbox(other))
    for outbox in outboxes:
        await outbox.ensure_indexes()
    where = [f"--uri={mongo.uri}"] + ([] if tenants else [f"--db={db.name}"])
    given = [o.format(db=db.name) for o in options]
    events = [e for outbox in outboxes for e in await save(outbox, unique)]
    relay = await Service("relay", *where, f"--rabbitmq={RABBITMQ_URL}", *given).start()
    try:
        await arrived(queue, events)
        ran = await relay.stop(signal.SIGTERM, timeout=30)
    finally:
        relay.kill()
        await client.drop_database(other.name)
    assert ran.code == 0, ran.output


async def test_every_documented_recovery_invocation_runs_at_its_defaults(
    mongo: MongoServer, db: Any, queue: Any, unique: str
) -> None:
    outbox = Outbox(db)
    await save(outbox, unique)
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL)
    try:
        assert await PollingRelay(outbox, publisher).drain() == 2
    finally:
        await publisher.aclose()
    where = [f"--uri={mongo.uri}", f"--db={db.name}"]
    for command in (
        ["ensure-indexes"],
        ["ensure-indexes", "--inbox"],
        ["status"],
        ["parked", "list"],
        ["inbox", "failed"],
        ["replay", "--since=1h", f"--rabbitmq={RABBITMQ_URL}", "--dry-run"],
        ["replay", "--since=1h", f"--rabbitmq={RABBITMQ_URL}"],
    ):
        ran = await cli(*command, *where)
        assert ran.code == 0, (command, ran.output)
