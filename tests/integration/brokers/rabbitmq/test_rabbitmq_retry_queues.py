"""``consume_rabbitmq``'s retry queues against the real RabbitMQ: a retry waits in the broker,
not in a prefetch slot; copies keep the message's properties; max_attempts and poison still end
in the dead letter; a copy the broker does not take leaves the message held in the process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import aio_pika
import pytest

from mongo_outbox import Backoff, Event, Inbox, PoisonMessage, inbox_guard
from mongo_outbox.brokers.rabbitmq._retry_queues import RETRIES_HEADER, RetryQueues, retry_buckets
from mongo_outbox.consumers import consume_rabbitmq
from tests.support.queues import ready_count
from tests.support.waiting import until

TIMEOUT = 30.0
SENT_AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


async def publish(channel: Any, queue: str, event: Event, **properties: Any) -> None:
    message = aio_pika.Message(event.model_dump_json().encode(), message_id=event.id, **properties)
    await channel.default_exchange.publish(message, routing_key=queue)


@contextlib.asynccontextmanager
async def consuming(queue: Any, guarded: Any, **options: Any) -> AsyncIterator[asyncio.Task[None]]:
    stop = asyncio.Event()
    task = asyncio.create_task(consume_rabbitmq(queue, guarded, stop=stop, **options))
    try:
        yield task
    finally:
        stop.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(task, 10)


async def test_a_retry_waiting_its_delay_holds_no_prefetch_slot(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    """Prefetch 1: while the first message waits 2 s in its retry queue, the four behind it
    are handled (a retry held in the process would block them all)."""
    channel = await amqp_connection.channel()
    await channel.set_qos(prefetch_count=1)
    queue = await channel.declare_queue(unique, exclusive=True)
    events = [Event(type="order.placed", aggregate_type="orders", aggregate_id=n) for n in range(5)]
    for event in events:
        await publish(channel, unique, event)
    slow = events[0]
    failed_at: list[float] = []
    handled: dict[str, float] = {}

    @inbox_guard(Inbox(db, consumer="billing"), backoff=Backoff(initial=2, maximum=2))
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        if event.id == slow.id and attempt == 1:
            failed_at.append(time.monotonic())
            raise ConnectionError("ledger busy")
        handled[event.id] = time.monotonic()

    async def all_handled() -> bool:
        return len(handled) == len(events)

    async with consuming(queue, bill):
        await until(all_handled, TIMEOUT)
    assert all(handled[e.id] < handled[slow.id] for e in events[1:])
    assert handled[slow.id] - failed_at[0] >= 2.0  # the whole delay, served by the broker
    assert await queue.get(fail=False, timeout=1) is None
    await channel.close()


async def test_a_copy_keeps_the_message_s_properties_and_counts_its_trips(
    amqp_connection: Any, unique: str
) -> None:
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique, exclusive=True)
    event = Event(type="order.placed", aggregate_type="orders", aggregate_id=7)
    await publish(
        channel,
        unique,
        event,
        headers={"aggregate-type": "orders", "aggregate-id": "7"},
        content_type="application/json",
        correlation_id="c-1",
        app_id="shop",
        type="order.placed",
        timestamp=SENT_AT,
        priority=3,
    )
    retries = RetryQueues(queue, Backoff(initial=0.05, maximum=0.05))
    await retries.declare()
    try:
        original = await queue.get(timeout=5)
        assert await retries.send(original, 0.01) == f"{unique}.retry.50"
        await original.ack()
        for trip in (1, 2):

            async def back() -> bool:
                return await ready_count(channel, unique) == 1

            await until(back, TIMEOUT)
            copy = await queue.get(timeout=5)
            assert (copy.message_id, copy.body) == (event.id, original.body)
            assert (copy.content_type, copy.correlation_id, copy.app_id, copy.type) == (
                "application/json",
                "c-1",
                "shop",
                "order.placed",
            )
            assert (copy.timestamp, copy.priority) == (SENT_AT, 3)
            assert copy.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
            assert copy.headers["aggregate-id"] == "7"
            assert copy.headers[RETRIES_HEADER] == trip
            if trip == 1:
                await retries.send(copy, 0.05)
            await copy.ack()
    finally:
        await retries.close()
        await channel.close()


def failing(db: Any, runs: list[int], dead: list[str], *, poison: bool = False) -> Any:
    async def dead_letter(event: Event, reason: str) -> None:
        dead.append(reason)

    @inbox_guard(
        Inbox(db, consumer="billing", transactional=False),
        max_attempts=5,
        backoff=Backoff(initial=0.01, maximum=0.02),
        dead_letter=dead_letter,
    )
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(attempt)
        if poison:
            raise PoisonMessage("cannot be billed")
        raise ConnectionError("ledger down")

    return bill


async def test_max_attempts_end_the_retries_through_retry_queues_of_a_quorum_queue(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    """x-delivery-limit 2: each copy is a new message to the broker, so the inbox's attempt
    records are what stop the retries, at max_attempts (5), in the dead letter."""
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(
        unique, durable=True, arguments={"x-queue-type": "quorum", "x-delivery-limit": 2}
    )
    retry_queues = [f"{unique}.retry.{ms}" for ms in retry_buckets(Backoff(0.01, 0.02))]
    try:
        event = Event(type="order.placed", aggregate_type="orders", aggregate_id=1)
        await publish(channel, unique, event)
        runs: list[int] = []
        dead: list[str] = []

        async def dead_lettered() -> bool:
            return bool(dead)

        async with consuming(queue, failing(db, runs, dead)):
            await until(dead_lettered, TIMEOUT)
        assert runs == [1, 2, 3, 4, 5]
        assert dead == ["gave up after 5: ConnectionError: ledger down"]
        [record] = await db.inbox.find().to_list(None)
        assert (record["status"], record["attempts"]) == ("failed", 5)
        for name in [unique, *retry_queues]:
            assert await ready_count(channel, name) == 0
    finally:
        for name in retry_queues:
            await channel.queue_delete(name)
        await queue.delete(if_unused=False, if_empty=False)
        await channel.close()


async def test_a_poison_message_goes_to_the_dead_letter_not_to_a_retry_queue(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique, exclusive=True)
    event = Event(type="order.placed", aggregate_type="orders", aggregate_id=1)
    await publish(channel, unique, event)
    runs: list[int] = []
    dead: list[str] = []

    async def dead_lettered() -> bool:
        return bool(dead)

    async with consuming(queue, failing(db, runs, dead, poison=True)):
        await until(dead_lettered, TIMEOUT)
        await asyncio.sleep(0.2)  # a copy sent to a retry queue would be back by now
    assert (runs, dead) == ([1], ["cannot be billed"])
    for ms in retry_buckets(Backoff(0.01, 0.02)):
        assert await ready_count(channel, f"{unique}.retry.{ms}") == 0
    assert await queue.get(fail=False, timeout=1) is None
    await channel.close()


async def test_a_copy_the_broker_does_not_take_leaves_the_message_held_in_the_process(
    db: Any, amqp_connection: Any, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The retry queue vanished under the consumer: the copy comes back unroutable, and the
    message is held for its delay and requeued, as without retry queues."""
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique, exclusive=True)
    event = Event(type="order.placed", aggregate_type="orders", aggregate_id=1)
    await publish(channel, unique, event)
    runs: list[int] = []

    @inbox_guard(Inbox(db, consumer="billing"), backoff=Backoff(initial=0.05, maximum=0.05))
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(attempt)
        if attempt == 1:
            await channel.queue_delete(f"{unique}.retry.50")
            raise ConnectionError("ledger busy")

    async def handled() -> bool:
        return runs == [1, 2]

    async with consuming(queue, bill):
        await until(handled, TIMEOUT)
    assert "could not send message" in caplog.text and "NO_ROUTE" in caplog.text
    [record] = await db.inbox.find().to_list(None)
    assert (record["status"], record["attempts"]) == ("done", 2)
    assert await queue.get(fail=False, timeout=1) is None
    await channel.close()
