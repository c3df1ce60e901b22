"""A consumer stopped while its handler hangs gives the message back, so that another consumer of
the same name (a restarted process, a second replica) handles it at once, as its first attempt:
the handler is cancelled, the consumer's keep-alive ends, the broker has the message again, and
a leased inbox claim is let go. The leased claim used to be kept, and the next delivery waited
out the rest of ``processing_lease`` (60 s); a FastStream handler cancelled by its broker's stop
left its NATS message to ``ack_wait``; earlier, a cancelled ``consume_nats`` kept renewing the
message for as long as the process lived.

Each consumer kind the library has: ``consume_nats``, ``consume_rabbitmq``, ``consume_redis``
(each cancelled, or stopped and then cancelled when its stop does not return, as a supervisor's
timeout would), and a FastStream subscriber guarded by ``inbox_handler`` on NATS and RabbitMQ
(ended by its broker's stop, which cancels running handlers after ``graceful_timeout``); with
the inbox in either mode. The deadline is the broker's: handled before the broker would have
taken the message back from the quiet first consumer by itself."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aio_pika
import pytest
from faststream.nats import ConsumerConfig as FastStreamConsumerConfig
from faststream.nats import JStream, NatsBroker, PullSub
from faststream.rabbit import RabbitBroker, RabbitQueue
from nats.js.api import ConsumerConfig
from redis.asyncio import Redis

from mongo_outbox import Backoff, Event, Inbox, inbox_guard
from mongo_outbox.brokers.rabbitmq._retry_queues import retry_buckets
from mongo_outbox.consumers import consume_nats, consume_rabbitmq, consume_redis
from mongo_outbox.faststream import inbox_handler
from mongo_outbox.publishers import NatsPublisher, RabbitMQPublisher, RedisStreamsPublisher
from tests.support.servers import NATS_URL, RABBITMQ_URL, REDIS_URL

ACK_WAIT = 6.0
"""Seconds: the NATS consumers' ack_wait, the Redis consumers' claim_idle: when the broker
would take a message back from a consumer that went quiet."""
PROMPTLY = 3 * ACK_WAIT
"""How long the test waits for the second consumer to handle the message."""
GRACE = 1.0
"""Seconds a FastStream broker's stop waits for running handlers before it cancels them."""


class Handlers:
    """The first consumer's handler hangs on each of ``messages``; the second's records them."""

    def __init__(self, db: Any, transactional: bool, messages: int) -> None:
        self.db = db
        self.transactional = transactional
        self.messages = messages
        self.hanging = 0
        self.started = asyncio.Event()
        """Set once the first consumer's handler hangs on every message."""
        self.ended = 0
        self.handled = asyncio.Event()
        """Set once the second consumer handled every message."""
        self.started_at = self.handled_at = 0.0
        self.attempts: list[int] = []

    def inbox(self) -> Inbox:
        # A fresh Inbox object per consumer, as two processes would have.
        return Inbox(self.db, consumer="billing", transactional=self.transactional)

    async def hang(self, event: Event, session: Any) -> None:
        if not self.hanging:
            self.started_at = asyncio.get_running_loop().time()
        self.hanging += 1
        if self.hanging == self.messages:
            self.started.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.ended += 1

    async def handle(self, event: Event, session: Any, *, attempt: int) -> None:
        await self.db.invoices.insert_one({"event": event.id}, session=session)
        self.attempts.append(attempt)
        if len(self.attempts) == self.messages:
            self.handled_at = asyncio.get_running_loop().time()
            self.handled.set()


Start = Callable[[Any], Awaitable[Callable[[str], Awaitable[None]]]]
"""``await start(guarded)`` runs a consumer of the guarded handler and returns ``end``:
``await end(how)`` ends it, ``how`` being ``"cancel"`` or ``"stop"``."""


async def stopping(task: asyncio.Task[None], stop: asyncio.Event, how: str) -> None:
    """End a consumer task: ``cancel`` it, or ``stop`` it and cancel it when it does not return
    within a second (it waits for its hanging handler)."""
    if how == "cancel":
        task.cancel()
    else:
        stop.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 1)
        task.cancel()
    done, _ = await asyncio.wait([task], timeout=15)
    assert done, "the consumer did not end once cancelled"
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


def running(consumer: Callable[[asyncio.Event], Awaitable[None]]) -> Any:
    """A consumer coroutine of ``stop`` as a task, and how to end it."""
    stop = asyncio.Event()
    task = asyncio.create_task(consumer(stop))

    async def end(how: str) -> None:
        await stopping(task, stop, how)

    return end


@contextlib.asynccontextmanager
async def nats_consumers(
    nats_client: Any, stream: str, events: list[Event]
) -> AsyncIterator[Start]:
    js = nats_client.jetstream()
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{stream}.{{type}}")
    await publisher.publish_many(events)
    await publisher.aclose()
    # The durable, with the ack wait the consumers find when they bind to it.
    config = ConsumerConfig(ack_wait=ACK_WAIT)
    await (
        await js.pull_subscribe(f"{stream}.>", "billing", stream=stream, config=config)
    ).unsubscribe()

    async def start(guarded: Any) -> Any:
        return running(
            lambda stop: consume_nats(
                js, f"{stream}.>", "billing", guarded, stream=stream, stop=stop
            )
        )

    yield start


@contextlib.asynccontextmanager
async def rabbitmq_consumers(
    amqp_connection: Any, unique: str, events: list[Event]
) -> AsyncIterator[Start]:
    channel = await amqp_connection.channel()
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(unique)
    await queue.bind(exchange, "#")
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    await publisher.publish_many(events)
    await publisher.aclose()

    async def start(guarded: Any) -> Any:
        own = await amqp_connection.channel()
        await own.set_qos(prefetch_count=10)
        mine = await own.declare_queue(unique, passive=True)
        return running(lambda stop: consume_rabbitmq(mine, guarded, stop=stop))

    try:
        yield start
    finally:
        await queue.delete(if_unused=False, if_empty=False)
        await delete_retry_queues(amqp_connection, unique)
        await exchange.delete()


async def delete_retry_queues(amqp_connection: Any, unique: str) -> None:
    """The retry queues a consumer of ``unique`` may have declared (the guard's backoff)."""
    channel = await amqp_connection.channel()
    for ms in retry_buckets(Backoff()):
        await channel.queue_delete(f"{unique}.retry.{ms}")
    await channel.close()


@contextlib.asynccontextmanager
async def redis_consumers(unique: str, events: list[Event]) -> AsyncIterator[Start]:
    client = Redis.from_url(REDIS_URL)
    await RedisStreamsPublisher(client, stream=unique).publish_many(events)

    async def start(guarded: Any) -> Any:
        return running(
            lambda stop: consume_redis(
                client, unique, "billing", guarded, claim_idle=ACK_WAIT, stop=stop
            )
        )

    try:
        yield start
    finally:
        await client.delete(unique, f"{unique}:dead")
        await client.aclose()


def faststream_app(broker: Any, subscribe: Callable[[Any], Any]) -> Start:
    """Each consumer a FastStream broker of its own (a process of its own), whose subscriber
    ``subscribe`` declares; ended by the broker's stop."""

    async def start(guarded_handler: Any) -> Any:
        app = broker()
        subscribe(app)(guarded_handler)
        await app.connect()
        await app.start()

        async def end(how: str) -> None:
            # Its stop waits graceful_timeout for running handlers, then cancels them.
            await asyncio.wait_for(app.stop(), 15)

        return end

    return start


@contextlib.asynccontextmanager
async def faststream_nats_consumers(
    nats_client: Any, stream: str, events: list[Event]
) -> AsyncIterator[Start]:
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{stream}.{{type}}")
    await publisher.publish_many(events)
    await publisher.aclose()

    def subscribe(app: Any) -> Any:
        return app.subscriber(
            f"{stream}.>",
            stream=JStream(stream, declare=False),
            durable="billing",
            pull_sub=PullSub(batch_size=len(events), timeout=0.5),
            config=FastStreamConsumerConfig(ack_wait=ACK_WAIT),
        )

    yield faststream_app(lambda: NatsBroker(NATS_URL, graceful_timeout=GRACE), subscribe)


@contextlib.asynccontextmanager
async def faststream_rabbitmq_consumers(
    amqp_connection: Any, unique: str, events: list[Event]
) -> AsyncIterator[Start]:
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique)
    for event in events:
        message = aio_pika.Message(event.model_dump_json().encode(), message_id=event.id)
        await channel.default_exchange.publish(message, routing_key=unique)

    def subscribe(app: Any) -> Any:
        return app.subscriber(RabbitQueue(unique, declare=False))

    try:
        yield faststream_app(lambda: RabbitBroker(RABBITMQ_URL, graceful_timeout=GRACE), subscribe)
    finally:
        await queue.delete(if_unused=False, if_empty=False)
        await delete_retry_queues(amqp_connection, unique)


CONSUMERS = ["nats", "rabbitmq", "redis", "faststream-nats", "faststream-rabbitmq"]


@pytest.mark.parametrize("transactional", [False, True], ids=["leased", "transactional"])
@pytest.mark.parametrize(
    ("kind", "how"),
    [(kind, how) for kind in CONSUMERS[:3] for how in ("cancel", "stop")]
    # FastStream stops its subscribers itself: its stop waits for running handlers for the
    # broker's graceful_timeout, then cancels them.
    + [(kind, "stop") for kind in CONSUMERS[3:]],
)
async def test_a_consumer_stopped_while_its_handler_hangs_gives_its_message_to_the_next(
    db: Any,
    nats_client: Any,
    nats_stream: str,
    amqp_connection: Any,
    unique: str,
    kind: str,
    how: str,
    transactional: bool,
) -> None:
    # Two messages, of two aggregates: both in the first consumer's hands when it ends.
    events = [Event(type="order.placed", aggregate_type="orders", aggregate_id=n) for n in (1, 2)]
    handlers = Handlers(db, transactional, len(events))
    if kind == "nats":
        consumers = nats_consumers(nats_client, nats_stream, events)
    elif kind == "faststream-nats":
        consumers = faststream_nats_consumers(nats_client, nats_stream, events)
    elif kind == "rabbitmq":
        consumers = rabbitmq_consumers(amqp_connection, unique, events)
    elif kind == "faststream-rabbitmq":
        consumers = faststream_rabbitmq_consumers(amqp_connection, unique, events)
    else:
        consumers = redis_consumers(unique, events)
    guard = inbox_handler if kind.startswith("faststream") else inbox_guard
    async with consumers as start:
        end_first = await start(guard(handlers.inbox())(handlers.hang))
        await asyncio.wait_for(handlers.started.wait(), 15)
        await end_first(how)
        assert handlers.ended == len(events), "a hanging handler was left running"
        end_second = await start(guard(handlers.inbox())(handlers.handle))
        try:
            await asyncio.wait_for(handlers.handled.wait(), PROMPTLY)
        finally:
            await end_second("stop")
    # Given back, by the consumer and by the inbox: handled before the broker would have taken
    # them back from the quiet first consumer (its ack wait since those deliveries), and not
    # held by the inbox for the rest of its processing lease (60 s).
    assert handlers.handled_at - handlers.started_at < ACK_WAIT
    # Once each, and as their first attempt: a stop spends none.
    assert handlers.attempts == [1, 1]
    invoices = await db.invoices.find().to_list(None)
    assert sorted(i["event"] for i in invoices) == sorted(e.id for e in events)
