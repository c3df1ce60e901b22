"""The relay end to end: saved with ``save_with_events``, drained by ``PollingRelay``, read back
from a real NATS stream or RabbitMQ queue; and what happens while the broker refuses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import pytest

from mongo_outbox import Backoff, Event, Outbox, PollingRelay, RelaySettings
from mongo_outbox.publishers import NatsPublisher, Publisher, RabbitMQPublisher
from tests.support.messages import bind_queue, drain_queue, read_stream
from tests.support.outboxes import MODES, assert_in_order, make_outbox, unsettled
from tests.support.servers import NATS_URL, RABBITMQ_URL
from tests.support.waiting import eventually

RETRY_FAST = Backoff(initial=0.01, maximum=0.05)
ONE_ATTEMPT = RelaySettings(publish_timeout=5, backoff=RETRY_FAST, max_attempts=1)


async def save_history(outbox: Outbox, db: Any, orders: int, saves: int) -> list[Event]:
    """``saves`` saves of each order, two events each, interleaved across orders."""
    committed: list[Event] = []
    for step in range(saves):
        for order in range(orders):
            saved = await outbox.save_with_events(
                None,
                db.orders,
                {"_id": order, "step": step},
                [Event(type="order.changed", payload={"step": step}), Event(type="order.noted")],
            )
            committed += saved.events
    return committed


async def save_and_abort(client: Any, outbox: Outbox, db: Any) -> None:
    """Events of a new and of an existing order, in a transaction aborted on purpose."""
    async with client.start_session() as session:
        with pytest.raises(RuntimeError):
            async with await session.start_transaction():
                for order in (0, 99):
                    await outbox.save_with_events(
                        session, db.orders, {"_id": order}, [Event(type="order.aborted")]
                    )
                raise RuntimeError("abort on purpose")


async def drain_until(relay: PollingRelay, expected: int, rounds: int = 200) -> int:
    """Drain until ``expected`` events went out, waiting out retry delays between rounds."""
    published = 0
    for _ in range(rounds):
        published += await relay.drain()
        if published >= expected:
            break
        await asyncio.sleep(0.02)
    return published


Reader = Callable[[int], Awaitable[list[Event]]]


@pytest.mark.parametrize("broker", ["nats", "rabbitmq"])
@pytest.mark.parametrize("mode", MODES)
async def test_every_saved_event_arrives_once_in_aggregate_order(
    client: Any,
    db: Any,
    nats_client: Any,
    nats_stream: str,
    channel: Any,
    unique: str,
    mode: str,
    broker: str,
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    committed = await save_history(outbox, db, orders=12, saves=3)
    await save_and_abort(client, outbox, db)
    publisher: Publisher
    if broker == "nats":
        publisher = await NatsPublisher.connect(
            NATS_URL, subject=f"{nats_stream}.{{aggregate_type}}.{{type}}"
        )
    else:
        queue = await bind_queue(channel, unique, "order.*")
        publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    relay = PollingRelay(
        outbox, publisher, settings=RelaySettings(batch_size=16)
    )  # several rounds, several waves
    try:
        assert await relay.drain() == len(committed)
        assert await relay.drain() == 0
    finally:
        await publisher.aclose()
    assert (relay.stats.published, relay.stats.failed) == (len(committed), 0)
    assert await unsettled(outbox, db) == []
    if broker == "nats":
        messages = await read_stream(nats_client, nats_stream, len(committed))
        assert all(m.headers["Nats-Msg-Id"] == Event.from_json(m.data).id for m in messages)
        received = [Event.from_json(m.data) for m in messages]
    else:
        messages = await drain_queue(queue, len(committed))
        assert all(m.message_id == Event.from_json(m.body).id for m in messages)
        received = [Event.from_json(m.body) for m in messages]
    assert_in_order(received, committed, once=True)  # exactly once; the aborted ones never
    for order in range(12):
        assert [e.sequence for e in received if e.aggregate_id == order] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("mode", MODES)
async def test_relay_backs_off_while_a_stream_is_missing_then_delivers_in_order(
    db: Any, nats_client: Any, unique: str, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    committed = await save_history(outbox, db, orders=6, saves=2)
    js = nats_client.jetstream()
    # Even orders go to a stream that exists, odd ones to one that does not yet.
    await js.add_stream(name=f"{unique}even", subjects=[f"{unique}even.>"])
    publisher = await NatsPublisher.connect(
        NATS_URL,
        subject=lambda e: f"{unique}{'odd' if int(e.aggregate_id or 0) % 2 else 'even'}.{e.type}",
    )
    # One attempt would park an entry: a missing stream is an outage, it must park nothing.
    relay = PollingRelay(outbox, publisher, settings=ONE_ATTEMPT)
    try:
        even = [e for e in committed if int(e.aggregate_id or 0) % 2 == 0]
        odd = [e for e in committed if int(e.aggregate_id or 0) % 2]
        assert await relay.drain() == len(even)  # an outage on some subjects blocks no others
        heads = {e.id for e in odd if e.sequence == 1}
        # Each odd order's head failed (and, retried within the drain, may have failed again);
        # nothing queued behind a head was tried, and no failure counted as an attempt.
        waiting = {
            entry.get("_id", entry.get("id")): entry for entry in await unsettled(outbox, db)
        }
        assert set(waiting) == {e.id for e in odd}
        assert {i for i, entry in waiting.items() if entry.get("last_error")} == heads
        assert all("NoStreamResponseError" in waiting[i]["last_error"] for i in heads)
        assert all(entry.get("attempts", 0) == 0 for entry in waiting.values())
        assert set(relay.stats.errors_by_type) == {"BrokerUnavailableError"}
        assert relay.stats.failed >= len(heads)

        # Still no stream: later rounds retry the same heads after their backoff, and fail.
        for _ in range(200):
            if relay.stats.failed >= 3 * len(heads):
                break
            assert await relay.drain() == 0
            await asyncio.sleep(0.01)
        assert relay.stats.failed >= 3 * len(heads)
        assert await relay.parked() == []

        await js.add_stream(name=f"{unique}odd", subjects=[f"{unique}odd.>"])
        assert await drain_until(relay, len(odd)) == len(odd)
        assert await unsettled(outbox, db) == []
        for name, sent in ((f"{unique}even", even), (f"{unique}odd", odd)):
            messages = await read_stream(nats_client, name, len(sent))
            received = [Event.from_json(m.data) for m in messages]
            assert_in_order(received, sent, once=True)  # the retried ones kept their ids
            assert [m.headers["Nats-Msg-Id"] for m in messages] == [e.id for e in received]
    finally:
        await publisher.aclose()
        for name in (f"{unique}even", f"{unique}odd"):
            if name in {info.config.name for info in await js.streams_info()}:
                await js.delete_stream(name)


@pytest.mark.parametrize("mode", MODES)
async def test_relay_retries_unroutable_messages_until_a_queue_is_bound(
    db: Any, channel: Any, unique: str, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    committed = await save_history(outbox, db, orders=4, saves=2)
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)  # no queue yet
    relay = PollingRelay(outbox, publisher, settings=ONE_ATTEMPT)
    try:
        assert await relay.drain() == 0
        assert relay.stats.failed == 4
        # Returned as unroutable: waiting for a queue, not the message's fault, so not parked.
        assert relay.stats.errors_by_type == {"BrokerUnavailableError": 4}
        assert "PublishError" in (relay.stats.last_error or "")
        assert "NO_ROUTE" in (relay.stats.last_error or "")
        assert await relay.parked() == []
        queue = await bind_queue(channel, unique)
        assert await drain_until(relay, len(committed)) == len(committed)
    finally:
        await publisher.aclose()
    assert await unsettled(outbox, db) == []
    messages = await drain_queue(queue, len(committed))
    assert [m.message_id for m in messages] == [Event.from_json(m.body).id for m in messages]
    assert_in_order([Event.from_json(m.body) for m in messages], committed, once=True)


async def publish_all(relay: PollingRelay, outbox: Outbox, db: Any, between: Any = None) -> None:
    """Drain until nothing is left unpublished (``between()`` runs after each round), waiting
    out the backoff of retried entries; fails after 60 s."""
    deadline = asyncio.get_running_loop().time() + 60
    while await unsettled(outbox, db):
        assert asyncio.get_running_loop().time() < deadline, await unsettled(outbox, db)
        await relay.drain()
        if between is not None:
            await between()
        await asyncio.sleep(0.05)


def first_deliveries(messages: list[Any], order: int) -> list[int | None]:
    """The order's sequences as first delivered (a republished event counts once)."""
    events = [Event.from_json(m.body) for m in messages]
    return list(dict.fromkeys(e.sequence for e in events if e.aggregate_id == order))


@pytest.mark.parametrize("mode", MODES)
async def test_relay_parks_nothing_while_the_exchange_is_missing_and_keeps_order(
    db: Any, channel: Any, unique: str, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    committed = await save_history(outbox, db, orders=4, saves=2)
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    await channel.exchange_delete(unique)  # the exchange is missing (404 on publish)
    # One counted attempt would park an event: a missing exchange is an outage, not the event's.
    relay = PollingRelay(outbox, publisher, settings=ONE_ATTEMPT)
    try:
        assert await relay.drain() == 0
        assert relay.stats.failed > 0
        assert set(relay.stats.errors_by_type) == {"BrokerUnavailableError"}
        assert await relay.parked() == []
        queue = await bind_queue(channel, unique)  # the operator puts it back
        # Once the publisher is through (the broker may have dropped the whole connection for
        # frames aiormq sent on the closed channel: up to connect_robust's 5 s), the relay
        # delivers everything.
        probe = Event(type="probe")
        await eventually(lambda: publisher.publish(probe))
        await publish_all(relay, outbox, db)
    finally:
        await publisher.aclose()
    assert await relay.parked() == []
    messages = []
    while (message := await queue.get(fail=False, timeout=5)) is not None:
        await message.ack()
        if message.message_id != probe.id:
            messages.append(message)
    assert {Event.from_json(m.body).id for m in messages} == {e.id for e in committed}
    for order in range(4):
        assert first_deliveries(messages, order) == [1, 2, 3, 4]


@pytest.mark.parametrize("mode", MODES)
async def test_relay_waits_for_room_in_a_full_queue_and_keeps_order(
    db: Any, channel: Any, unique: str, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    committed = await save_history(outbox, db, orders=4, saves=2)
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(
        exclusive=True, arguments={"x-max-length": 3, "x-overflow": "reject-publish"}
    )
    await queue.bind(exchange, "#")
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    # A counted nack would park.
    relay = PollingRelay(outbox, publisher, settings=ONE_ATTEMPT)
    received: list[Any] = []

    async def consume() -> None:  # a slow consumer: makes room, three at a time
        while (message := await queue.get(fail=False, timeout=5)) is not None:
            await message.ack()
            received.append(message)

    try:
        assert await relay.drain() == 3  # the queue holds three; the rest is nacked
        assert relay.stats.errors_by_type == {"BrokerFullError": relay.stats.failed}
        assert await relay.parked() == []
        await publish_all(relay, outbox, db, between=consume)
        await consume()
    finally:
        await publisher.aclose()
    assert await relay.parked() == []
    assert {Event.from_json(m.body).id for m in received} == {e.id for e in committed}
    for order in range(4):
        assert first_deliveries(received, order) == [1, 2, 3, 4]


class ClosesAfter:
    """Publishes through ``inner``; after ``after`` confirms it closes ``inner`` in the
    background, as an application shutting down does, while other publishes are in flight."""

    def __init__(self, inner: Publisher, after: int) -> None:
        self.inner = inner
        self.after = after
        self.confirmed = 0
        self.closing: asyncio.Task[None] | None = None

    async def publish(self, event: Event) -> None:
        await self.inner.publish(event)
        self.confirmed += 1
        if self.confirmed == self.after:
            self.closing = asyncio.create_task(self.inner.aclose())

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_closing_the_publisher_mid_run_leaves_the_relay_running(
    db: Any, channel: Any, unique: str
) -> None:
    outbox = make_outbox(db, "collection")
    await outbox.ensure_indexes()
    await save_history(outbox, db, orders=60, saves=2)
    await bind_queue(channel, unique)
    # A short timeout: aiormq 6 (Python 3.10) leaves a publish caught by the close hanging.
    inner = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique, timeout=1)
    publisher = ClosesAfter(inner, 10)
    relay = PollingRelay(outbox, publisher)
    task = asyncio.create_task(relay.run())
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while publisher.closing is None or not relay.stats.failed:
            assert not task.done(), task
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        await publisher.closing
        await asyncio.sleep(0.2)  # a round or two against the closed publisher
        assert not task.done()  # not ended as cancelled, nor by an error
        assert set(relay.stats.errors_by_type) == {"BrokerUnavailableError"}
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    assert await relay.parked() == []
