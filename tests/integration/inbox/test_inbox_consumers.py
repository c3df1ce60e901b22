"""Guarded handlers behind the RabbitMQ and NATS consumer helpers, fed by the relay."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import aio_pika
import nats.js.errors
import pytest
from nats.js.api import ConsumerConfig
from redis.asyncio import Redis

from mongo_outbox import Backoff, Event, Inbox, inbox_guard
from mongo_outbox.brokers.nats.consumer import _Delivery
from mongo_outbox.consumers import consume_nats, consume_rabbitmq, consume_redis
from mongo_outbox.publishers import NatsPublisher, RabbitMQPublisher, RedisStreamsPublisher
from tests.support.billing import (
    concurrency,
    guarded_billing,
    relay_twice,
    save_orders,
    wait_for_invoices,
)
from tests.support.brokers import FaultyGate
from tests.support.servers import NATS_URL, RABBITMQ_URL, REDIS_URL
from tests.support.waiting import until


async def test_rabbitmq_end_to_end_each_effect_once(
    db: Any, mongo: Any, amqp_connection: Any, unique: str
) -> None:
    saved = await save_orders(db, 12)
    channel = await amqp_connection.channel()
    await channel.set_qos(prefetch_count=concurrency(mongo))
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(exclusive=True)
    await queue.bind(exchange, "#")
    await relay_twice(db, await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique))
    # A message that cannot be handled: its body is not an Event. (One without a message_id
    # cannot be sent through aio-pika: aiormq gives every message a random id; see below.)
    await exchange.publish(aio_pika.Message(b"not json", message_id="m-1"), routing_key="x")
    rejected: list[str] = []

    async def on_rejected(body: bytes, reason: str) -> None:
        rejected.append(reason)

    flaky = {saved[0].id, saved[5].id}
    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_rabbitmq(queue, guarded_billing(db, flaky=flaky), rejected=on_rejected, stop=stop)
    )
    invoices = await wait_for_invoices(db, len(saved))
    await until(lambda: bool(rejected))  # the bad message may come last: stop once it was seen
    stop.set()
    await asyncio.wait_for(task, 10)
    assert invoices == {e.id: 1 for e in saved}
    assert len(rejected) == 1 and "m-1 is not an Event" in rejected[0]
    assert await queue.get(fail=False, timeout=1) is None  # everything settled, nothing requeued
    await exchange.delete()
    await channel.close()


async def test_nats_end_to_end_each_effect_once(
    db: Any, mongo: Any, nats_client: Any, unique: str
) -> None:
    saved = await save_orders(db, 12)
    js = nats_client.jetstream()
    # A short duplicate window: the broker must not hide the republished copies from the inbox.
    await js.add_stream(name=unique, subjects=[f"{unique}.>"], duplicate_window=0.1)
    try:
        await relay_twice(db, await NatsPublisher.connect(NATS_URL, subject=f"{unique}.{{type}}"))
        assert (await js.stream_info(unique)).state.messages == 2 * len(saved)
        await nats_client.publish(f"{unique}.raw", b"{}")  # core publish: no Nats-Msg-Id
        rejected: list[str] = []

        async def on_rejected(body: bytes, reason: str) -> None:
            rejected.append(reason)

        stop = asyncio.Event()
        flaky = {saved[3].id}
        task = asyncio.create_task(
            consume_nats(
                js,
                f"{unique}.>",
                "billing",
                guarded_billing(db, flaky=flaky),
                stream=unique,
                batch=concurrency(mongo),
                rejected=on_rejected,
                stop=stop,
            )
        )
        invoices = await wait_for_invoices(db, len(saved))
        await until(lambda: bool(rejected))  # the bad message may come last
        stop.set()
        await asyncio.wait_for(task, 10)
        assert invoices == {e.id: 1 for e in saved}
        assert len(rejected) == 1 and "no id" in rejected[0]
        info = await js.consumer_info(unique, "billing")
        assert info.num_pending == 0 and info.num_ack_pending == 0
    finally:
        await js.delete_stream(unique)


class FakeRabbitMQMessage:
    """Stands in for an aio-pika IncomingMessage without a message_id, which other AMQP clients
    can send but aio-pika cannot produce for a real broker to deliver."""

    def __init__(self, body: bytes) -> None:
        self.message_id: str | None = None
        self.body = body
        self.headers: dict[str, object] = {}
        self.content_type = "application/json"
        self.settled: list[str] = []

    async def reject(self, requeue: bool = False) -> None:
        self.settled.append(f"reject(requeue={requeue})")

    async def ack(self) -> None:
        self.settled.append("ack")


async def test_rabbitmq_message_without_id_is_rejected_not_processed(db: Any) -> None:
    from mongo_outbox.consumers import handle_rabbitmq_message

    reasons: list[str] = []

    async def on_rejected(body: bytes, reason: str) -> None:
        reasons.append(reason)

    message = FakeRabbitMQMessage(Event(type="order.placed").model_dump_json().encode())
    assert await handle_rabbitmq_message(message, guarded_billing(db), rejected=on_rejected) is None
    assert message.settled == ["reject(requeue=False)"]
    assert len(reasons) == 1 and "no id" in reasons[0]
    assert await db.invoices.count_documents({}) == 0


@contextlib.asynccontextmanager
async def consuming(consumer: Awaitable[None], stop: asyncio.Event) -> AsyncIterator[Any]:
    """Run a consumer in a task; stop it (or, failing that, cancel it) whatever happens."""
    task = asyncio.create_task(consumer)
    try:
        yield task
    finally:
        stop.set()
        with contextlib.suppress(asyncio.TimeoutError):  # wait_for cancelled it
            await asyncio.wait_for(task, 10)


def always_failing(db: Any, runs: list[int], dead: list[str], **inbox: Any) -> Any:
    async def dead_letter(event: Event, reason: str) -> None:
        dead.append(reason)

    @inbox_guard(
        Inbox(db, consumer="billing", **inbox),
        max_attempts=5,
        backoff=Backoff(initial=0.01, maximum=0.02),
        dead_letter=dead_letter,
    )
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(attempt)
        raise ConnectionError("ledger down")

    return bill


@pytest.mark.parametrize(
    ("ordered", "retry_queues"),
    [(True, True), (False, False)],
    ids=["ordered", "without-retry-queues"],
)
async def test_stopping_consume_rabbitmq_requeues_a_held_retry_at_once(
    db: Any, amqp_connection: Any, unique: str, ordered: bool, retry_queues: bool
) -> None:
    """A retry held in the process waits up to Backoff.maximum (here 300 s); stop must not."""
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique, exclusive=True)
    event = Event(type="order.placed", aggregate_type="orders", aggregate_id=1)
    body = event.model_dump_json().encode()
    await channel.default_exchange.publish(
        aio_pika.Message(body, message_id=event.id), routing_key=unique
    )

    @inbox_guard(Inbox(db, consumer="billing", transactional=False), backoff=Backoff(initial=300))
    async def bill(event: Event, session: Any) -> None:
        raise ConnectionError("ledger busy")

    async def failed_once() -> bool:
        return await db.inbox.count_documents({"status": "retrying"}) == 1

    stop = asyncio.Event()
    consumer = consume_rabbitmq(queue, bill, ordered=ordered, stop=stop, retry_queues=retry_queues)
    async with consuming(consumer, stop) as task:
        await until(failed_once, timeout=15)  # the message is held for its retry delay now
        started = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 10)
        stopped_in = time.monotonic() - started
    assert stopped_in < 1.0, f"stop took {stopped_in:.1f}s"
    again = await queue.get(timeout=5)
    assert (again.message_id, again.redelivered) == (event.id, True)
    await again.ack()
    await channel.close()


async def test_stopping_consume_rabbitmq_leaves_a_retry_in_its_retry_queue(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    """Unordered, the retry waits in the broker: stop has nothing to give back."""
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique, exclusive=True)
    event = Event(type="order.placed", aggregate_type="orders", aggregate_id=1)
    await channel.default_exchange.publish(
        aio_pika.Message(event.model_dump_json().encode(), message_id=event.id),
        routing_key=unique,
    )

    @inbox_guard(Inbox(db, consumer="billing", transactional=False), backoff=Backoff(initial=300))
    async def bill(event: Event, session: Any) -> None:
        raise ConnectionError("ledger busy")

    async def failed_once() -> bool:
        return await db.inbox.count_documents({"status": "retrying"}) == 1

    stop = asyncio.Event()
    async with consuming(consume_rabbitmq(queue, bill, stop=stop), stop) as task:
        await until(failed_once, timeout=15)
        started = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 10)
        assert time.monotonic() - started < 1.0
    assert await queue.get(fail=False, timeout=1) is None
    waiting = await channel.declare_queue(f"{unique}.retry.300000", passive=True)
    assert waiting.declaration_result.message_count == 1
    await channel.close()


@pytest.mark.parametrize("limit", [0, 2])
async def test_rabbitmq_quorum_queue_s_last_delivery_is_dead_lettered(
    db: Any, amqp_connection: Any, unique: str, limit: int
) -> None:
    """x-delivery-limit 2 with max_attempts 5, retries held in the process: the broker would
    drop the message after its third delivery, never dead-lettered, its record left
    ``retrying``. With a limit of 0 the first delivery is the last: it carries no count, which
    was taken for no limit at all (one run, then dropped)."""
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(
        unique, durable=True, arguments={"x-queue-type": "quorum", "x-delivery-limit": limit}
    )
    try:
        event = Event(type="order.placed", aggregate_type="orders", aggregate_id=1)
        await channel.default_exchange.publish(
            aio_pika.Message(event.model_dump_json().encode(), message_id=event.id),
            routing_key=unique,
        )
        runs: list[int] = []
        dead: list[str] = []
        stop = asyncio.Event()
        guarded = always_failing(db, runs, dead, transactional=False)

        async def dead_lettered() -> bool:
            return bool(dead)

        consumer = consume_rabbitmq(queue, guarded, stop=stop, retry_queues=False)
        async with consuming(consumer, stop):
            await until(dead_lettered, timeout=15)
        deliveries = limit + 1
        assert runs == list(range(1, deliveries + 1))
        assert dead == [
            f"gave up after {deliveries} on the broker's last delivery: ConnectionError: "
            "ledger down"
        ]
        [record] = await db.inbox.find().to_list(None)
        assert (record["status"], record["attempts"]) == ("failed", deliveries)
        assert await queue.get(fail=False, timeout=1) is None
    finally:
        await queue.delete(if_unused=False, if_empty=False)
        await channel.close()


async def test_nats_consumer_s_last_delivery_is_dead_lettered(
    db: Any, nats_client: Any, nats_stream: str
) -> None:
    """max_deliver 3 with max_attempts 5: the broker would stop after the third delivery."""
    js = nats_client.jetstream()
    subject = f"{nats_stream}.>"
    await js.add_consumer(
        nats_stream, durable_name="billing", max_deliver=3, filter_subject=subject
    )
    event = Event(type="order.placed", aggregate_type="orders", aggregate_id=1)
    await js.publish(
        f"{nats_stream}.order", event.model_dump_json().encode(), headers={"Nats-Msg-Id": event.id}
    )
    runs: list[int] = []
    dead: list[str] = []
    stop = asyncio.Event()
    guarded = always_failing(db, runs, dead, transactional=False)

    async def dead_lettered() -> bool:
        return bool(dead)

    consumer = consume_nats(js, subject, "billing", guarded, stream=nats_stream, stop=stop)
    async with consuming(consumer, stop):
        await until(dead_lettered, timeout=15)
    assert runs == [1, 2, 3]
    assert dead == ["gave up after 3 on the broker's last delivery: ConnectionError: ledger down"]
    [record] = await db.inbox.find().to_list(None)
    assert (record["status"], record["attempts"]) == ("failed", 3)
    info = await js.consumer_info(nats_stream, "billing")
    assert info.num_pending == 0 and info.num_ack_pending == 0


async def test_a_nats_keep_alive_after_a_retry_s_nak_does_not_put_the_redelivery_off(
    nats_client: Any, nats_stream: str
) -> None:
    # The keep-alive reads the messages in flight, then sends +WPI for each: one settled by a
    # delayed nak in between got a +WPI after its nak, and JetStream then delivered it again
    # after ack_wait (10 s here), not after the retry's delay (1 s).
    js = nats_client.jetstream()
    await js.publish(f"{nats_stream}.e", b"{}")
    config = ConsumerConfig(ack_wait=10)
    subscription = await js.pull_subscribe(f"{nats_stream}.e", "billing", config=config)
    (message,) = await subscription.fetch(1, timeout=5)
    delivery = _Delivery(message, None)
    await delivery.retry_after(1.0, asyncio.Event())
    await delivery.keep_alive()
    try:
        (again,) = await subscription.fetch(1, timeout=5)
        assert again.metadata.num_delivered == 2
        await again.ack()
    finally:
        await subscription.unsubscribe()


@pytest.mark.parametrize("broker", ["nats", "rabbitmq", "redis"])
async def test_a_consumer_whose_inbox_cannot_be_indexed_stops_and_says_why(
    db: Any, nats_client: Any, nats_stream: str, amqp_connection: Any, unique: str, broker: str
) -> None:
    # A configuration error no retry fixes: the consumer does not start, and no message is
    # delivered meanwhile (a supervisor restarting it would use up their deliveries), instead
    # of every delivery failing as "inbox unavailable" for ever. The error names the index in
    # the way, which the emulator's own message does not.
    from mongo_outbox import ConfigurationError

    await db.inbox.create_index("expire_at", expireAfterSeconds=3600, name="my_ttl")
    event = Event(type="order.placed")
    runs: list[str] = []

    @inbox_guard(Inbox(db, consumer="c", transactional=False))
    async def handler(event: Event, session: Any) -> None:
        runs.append(event.id)

    said = "its index 'ttl' cannot be created: the index 'my_ttl' (on expire_at, expireAfterSeconds"
    if broker == "nats":
        publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
        await publisher.publish(event)
        await publisher.aclose()
        js = nats_client.jetstream()
        consumer = consume_nats(js, f"{nats_stream}.>", "c", handler, stream=nats_stream)
        with pytest.raises(ConfigurationError, match=re.escape(said)):
            await asyncio.wait_for(consumer, 10)
        # It never subscribed: the message waits in the stream, delivered to no one.
        assert (await js.stream_info(nats_stream)).state.messages == 1
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.consumer_info(nats_stream, "c")
    elif broker == "rabbitmq":
        channel = await amqp_connection.channel()
        queue = await channel.declare_queue(unique, auto_delete=False)
        try:
            message = aio_pika.Message(event.model_dump_json().encode(), message_id=event.id)
            await channel.default_exchange.publish(message, routing_key=unique)
            with pytest.raises(ConfigurationError, match=re.escape(said)):
                await asyncio.wait_for(consume_rabbitmq(queue, handler), 10)
            waiting = await queue.get(timeout=5)  # never consumed: still there
            assert waiting.message_id == event.id
            await waiting.ack()
        finally:
            await queue.delete(if_unused=False, if_empty=False)
    else:
        client = Redis.from_url(REDIS_URL)
        try:
            await RedisStreamsPublisher(client, stream=unique).publish(event)
            with pytest.raises(ConfigurationError, match=re.escape(said)):
                await asyncio.wait_for(consume_redis(client, unique, "c", handler), 10)
            assert await client.xinfo_groups(unique) == []  # it never read
        finally:
            await client.delete(unique)
            await client.aclose()
    assert runs == []


@pytest.mark.parametrize("how", ["refused", "hanging"])
async def test_stopping_consume_rabbitmq_while_rabbitmq_is_down_returns(
    db: Any, unique: str, how: str
) -> None:
    # Its cancel waited for the robust channel to come back: a stop during an outage did not
    # return (and raised "channel closed" once RabbitMQ was back).
    gate = FaultyGate()
    await gate.start()
    connection = await aio_pika.connect_robust(gate.url, timeout=5)
    try:
        queue = await (await connection.channel()).declare_queue(unique, auto_delete=True)

        @inbox_guard(Inbox(db, consumer="billing"), backoff=Backoff(initial=0.05, maximum=0.1))
        async def bill(event: Event, session: Any) -> None:
            pass

        stop = asyncio.Event()
        consumer = asyncio.create_task(consume_rabbitmq(queue, bill, stop=stop, retry_queues=False))
        await asyncio.sleep(0.5)  # consuming
        await gate.fail(how)
        stop.set()
        # A closed channel is not waited for; a silent one at most 5 s (_CANCEL_WAIT).
        done, _ = await asyncio.wait([consumer], timeout=10)
        assert done, f"consume_rabbitmq did not stop while RabbitMQ was {how}"
        assert consumer.exception() is None
    finally:
        await gate.heal()
        await connection.close()
