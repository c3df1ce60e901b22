"""FastStream subscribers guarded by ``inbox_handler``, fed by the relay through the real
RabbitMQ and NATS JetStream: each effect once, poison to the dead letter, no id rejected."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from datetime import datetime, timezone
from typing import Any

import aio_pika
import pytest
from faststream.nats import ConsumerConfig, JStream, NatsBroker
from faststream.rabbit import Channel, RabbitBroker, RabbitQueue
from pydantic import BaseModel, ConfigDict

from mongo_outbox import Backoff, Event, Inbox, PoisonMessage
from mongo_outbox.brokers.rabbitmq._retry_queues import retry_buckets
from mongo_outbox.faststream import inbox_handler
from mongo_outbox.publishers import NatsPublisher, RabbitMQPublisher
from tests.support.amqp import publish_without_message_id
from tests.support.billing import concurrency, relay_twice, save_orders
from tests.support.servers import NATS_URL, RABBITMQ_URL
from tests.support.waiting import until

FAST = Backoff(initial=0.05, maximum=0.1)


class StrictOrder(BaseModel):
    """Strict, with a field whose JSON form is a string: it must validate from the JSON payload."""

    model_config = ConfigDict(strict=True)
    n: int
    placed: datetime


def billing(db: Any, *, flaky: set[str], poison: set[str], **options: Any) -> Any:
    """A FastStream handler writing one invoice per order: events in ``flaky`` fail on their
    first attempt, those in ``poison`` on every one."""

    @inbox_handler(
        Inbox(db, consumer="billing", transactional=True), backoff=FAST, max_attempts=3, **options
    )
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        if event.id in poison:
            raise PoisonMessage("no such customer")
        if event.id in flaky and attempt == 1:
            raise ConnectionError("ledger busy")
        await db.invoices.insert_one({"event": event.id}, session=session)

    return bill


async def invoices_of(db: Any) -> Counter[str]:
    return Counter(d["event"] for d in await db.invoices.find().to_list(None))


async def settled(db: Any, expected: int) -> None:
    """Wait until ``expected`` inbox records are done or failed, then a little for extras."""

    async def all_settled() -> bool:
        query = {"status": {"$in": ["done", "failed"]}}
        return await db.inbox.count_documents(query) >= expected

    try:
        await until(all_settled, 90)
    except AssertionError:
        docs = await db.inbox.find({}, {"status": 1, "attempts": 1, "message_id": 1}).to_list(None)
        raise AssertionError(f"inbox: {docs}") from None
    await asyncio.sleep(0.5)  # a duplicate effect would have been written by now


async def test_nats_relay_to_faststream_each_effect_once(
    db: Any, mongo: Any, nats_client: Any, unique: str
) -> None:
    saved = await save_orders(db, 10)
    js = nats_client.jetstream()
    # A short duplicate window: the broker must not hide the republished copies from the inbox.
    await js.add_stream(name=unique, subjects=[f"{unique}.>"], duplicate_window=0.1)
    try:
        await relay_twice(db, await NatsPublisher.connect(NATS_URL, subject=f"{unique}.{{type}}"))
        # A storm: one event ten more times, each past the duplicate window.
        storm = saved[1]
        for _ in range(10):
            await js.publish(
                f"{unique}.storm",
                storm.model_dump_json().encode(),
                headers={"Nats-Msg-Id": storm.id},
            )
            await asyncio.sleep(0.12)
        # FastStream would give this one a random message_id; the guard must refuse it.
        await js.publish(f"{unique}.raw", Event(type="order.placed").model_dump_json().encode())
        rejected: list[str] = []

        async def on_rejected(body: bytes, reason: str) -> None:
            rejected.append(reason)

        poison = {saved[7].id}
        broker = NatsBroker(NATS_URL)
        broker.subscriber(
            f"{unique}.>",
            stream=JStream(unique, declare=False),
            # A push consumer: FastStream's pull loop restarts when nats-py 2.16 raises a bare
            # TimeoutError between its two pull requests, and may then handle two batches at
            # once.
            queue="billing",
            config=ConsumerConfig(ack_wait=30),
            max_workers=concurrency(mongo),
        )(billing(db, flaky={saved[3].id}, poison=poison, rejected=on_rejected))
        async with broker:
            await broker.start()
            await settled(db, len(saved))

            async def drained() -> bool:
                info = await js.consumer_info(unique, "billing")
                return info.num_pending == 0 and info.num_ack_pending == 0

            await until(drained, 30)
        handled = {e.id: 1 for e in saved if e.id not in poison}
        assert await invoices_of(db) == handled
        failed = await Inbox(db, consumer="billing").failed()
        assert [f["message_id"] for f in failed] == [saved[7].id]
        assert len(rejected) == 1 and "no id" in rejected[0]
    finally:
        await js.delete_stream(unique)


async def test_rabbitmq_relay_to_faststream_each_effect_once(
    db: Any, mongo: Any, amqp_connection: Any, unique: str
) -> None:
    saved = await save_orders(db, 10)
    channel = await amqp_connection.channel()
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(unique, auto_delete=True)
    await queue.bind(exchange, "#")
    try:
        await relay_twice(db, await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique))
        storm = saved[1]
        for _ in range(10):
            await exchange.publish(
                aio_pika.Message(storm.model_dump_json().encode(), message_id=storm.id), "storm"
            )
        await exchange.publish(aio_pika.Message(b"not json", message_id="m-1"), "x")
        # No message_id at all: FastStream's parser would invent one.
        await publish_without_message_id(
            RABBITMQ_URL, unique, "raw", Event(type="order.placed").model_dump_json().encode()
        )
        rejected: list[str] = []

        async def on_rejected(body: bytes, reason: str) -> None:
            rejected.append(reason)

        poison = {saved[7].id}
        broker = RabbitBroker(RABBITMQ_URL)
        broker.subscriber(
            RabbitQueue(unique, declare=False),
            channel=Channel(prefetch_count=concurrency(mongo)),
        )(billing(db, flaky={saved[3].id}, poison=poison, rejected=on_rejected))
        async with broker:
            await broker.start()
            await settled(db, len(saved))

            async def both_rejected() -> bool:
                return len(rejected) == 2

            await until(both_rejected, 30)
        handled = {e.id: 1 for e in saved if e.id not in poison}
        assert await invoices_of(db) == handled
        failed = await Inbox(db, consumer="billing").failed()
        assert [f["message_id"] for f in failed] == [saved[7].id]
        assert sorted(r.split(" ", 2)[1] for r in rejected) == ["id", "m-1"]
        declared = await channel.declare_queue(unique, passive=True)
        assert declared.declaration_result.message_count == 0  # all settled, none requeued
    finally:
        await exchange.delete()
        for ms in retry_buckets(FAST):  # the flaky one's retry went through them
            await channel.queue_delete(f"{unique}.retry.{ms}")
        await channel.close()


@pytest.mark.parametrize("transport", ["nats", "rabbitmq"])
async def test_typed_payload_reaches_the_handler_and_a_misfit_is_dead_lettered(
    db: Any, nats_client: Any, amqp_connection: Any, unique: str, transport: str
) -> None:
    placed = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    good = Event.of(StrictOrder(n=7, placed=placed), type="order.placed")
    misfit = Event(type="order.placed", payload={"n": "seven", "placed": placed.isoformat()})
    seen: list[StrictOrder] = []

    @inbox_handler(
        Inbox(db, consumer="typed", transactional=True), payload=StrictOrder, backoff=FAST
    )
    async def typed(order: StrictOrder, session: Any) -> None:
        seen.append(order)
        await db.invoices.insert_one({"n": order.n}, session=session)

    async def dead() -> bool:
        # The misfit dead-lettered, the good one handled.
        done = await db.inbox.count_documents({"status": "done"})
        return done == 1 and len(await Inbox(db, consumer="typed").failed()) == 1

    if transport == "nats":
        js = nats_client.jetstream()
        await js.add_stream(name=unique, subjects=[f"{unique}.>"])
        try:
            for event in (good, misfit):
                body = event.model_dump_json().encode()
                await js.publish(f"{unique}.o", body, headers={"Nats-Msg-Id": event.id})
            broker: Any = NatsBroker(NATS_URL)
            broker.subscriber(
                f"{unique}.>",
                stream=JStream(unique, declare=False),
                queue="typed",
            )(typed)
            async with broker:
                await broker.start()
                await until(dead, 30)
        finally:
            await js.delete_stream(unique)
    else:
        channel = await amqp_connection.channel()
        queue = await channel.declare_queue(unique, auto_delete=True)
        for event in (good, misfit):
            body = event.model_dump_json().encode()
            await channel.default_exchange.publish(
                aio_pika.Message(body, message_id=event.id), unique
            )
        broker = RabbitBroker(RABBITMQ_URL)
        broker.subscriber(RabbitQueue(unique, declare=False))(typed)
        async with broker:
            await broker.start()
            await until(dead, 30)
        await queue.delete(if_unused=False, if_empty=False)
        await channel.close()
    # A handler may run more than once (a transaction that failed to commit is retried); its
    # effect in MongoDB is there once.
    assert seen and all(order == StrictOrder(n=7, placed=placed) for order in seen)
    assert [i["n"] for i in await db.invoices.find().to_list(None)] == [7]
    failed = await Inbox(db, consumer="typed").failed()
    assert failed[0]["message_id"] == misfit.id and "not a StrictOrder" in failed[0]["last_error"]
    # Dead-lettered at once (it would never fit), and its error's class said.
    assert failed[0]["attempts"] == 1
    assert failed[0]["last_error"].startswith("InvalidEventError: the payload of event")


async def test_nats_last_delivery_is_dead_lettered_not_dropped(
    db: Any, nats_client: Any, unique: str
) -> None:
    """max_deliver=2 and a handler that always fails: the guard would retry 5 times, but the
    broker delivers twice; the second delivery dead-letters the message instead."""
    js = nats_client.jetstream()
    await js.add_stream(name=unique, subjects=[f"{unique}.>"])
    event = Event(type="order.placed")
    runs: list[int] = []

    @inbox_handler(
        Inbox(db, consumer="billing", transactional=True),
        backoff=FAST,
        max_attempts=5,
        delivery_limit=2,
    )
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(attempt)
        raise ConnectionError("ledger down")

    try:
        await js.publish(
            f"{unique}.o", event.model_dump_json().encode(), headers={"Nats-Msg-Id": event.id}
        )
        broker = NatsBroker(NATS_URL)
        broker.subscriber(
            f"{unique}.>",
            stream=JStream(unique, declare=False),
            queue="billing",
            config=ConsumerConfig(max_deliver=2),
        )(bill)

        async def dead() -> bool:
            return len(await Inbox(db, consumer="billing").failed()) == 1

        async with broker:
            await broker.start()
            await until(dead, 30)

            async def settled() -> bool:
                info = await js.consumer_info(unique, "billing")
                return info.num_ack_pending == 0 and info.num_pending == 0

            await until(settled, 30)
    finally:
        await js.delete_stream(unique)
    assert runs == [1, 2]
    failed = await Inbox(db, consumer="billing").failed()
    assert failed[0]["message_id"] == event.id and "ledger down" in failed[0]["last_error"]


async def test_setting_stop_requeues_a_rabbitmq_message_held_for_its_retry(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    """Without retry queues a retry is held in the process for its delay (here 300 s): stop
    requeues it at once."""
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique)
    event = Event(type="order.placed")
    await channel.default_exchange.publish(
        aio_pika.Message(event.model_dump_json().encode(), message_id=event.id), unique
    )
    stop = asyncio.Event()

    @inbox_handler(
        Inbox(db, consumer="billing", transactional=False),
        backoff=Backoff(initial=300),
        stop=stop,
        retry_queues=False,
    )
    async def bill(event: Event, session: Any) -> None:
        raise ConnectionError("ledger busy")

    async def held() -> bool:
        return await db.inbox.count_documents({"status": "retrying"}) == 1

    broker = RabbitBroker(RABBITMQ_URL)
    broker.subscriber(RabbitQueue(unique, declare=False))(bill)
    async with broker:
        await broker.start()
        await until(held, 30)
        started = time.monotonic()
        stop.set()  # as an app's on_shutdown would, before FastStream stops the subscriber
        await broker.stop()
    assert time.monotonic() - started < 10
    again = await queue.get(timeout=5)
    assert (again.message_id, again.redelivered) == (event.id, True)
    await again.ack()
    await queue.delete(if_unused=False, if_empty=False)
    await channel.close()


async def test_a_rabbitmq_retry_waits_in_a_retry_queue_not_in_the_process(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    """As with consume_rabbitmq, a retry is a confirmed copy in ``<queue>.retry.<ms>``: the
    original is acked (no prefetch slot held), and the wait survives the consumer stopping."""
    channel = await amqp_connection.channel()
    await channel.declare_queue(unique)
    retry_queue = f"{unique}.retry.5000"
    event = Event(type="order.placed")
    await channel.default_exchange.publish(
        aio_pika.Message(event.model_dump_json().encode(), message_id=event.id), unique
    )
    runs: list[int] = []

    @inbox_handler(
        Inbox(db, consumer="billing", transactional=False),
        backoff=Backoff(initial=5, maximum=5),
    )
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(attempt)
        if attempt == 1:
            raise ConnectionError("ledger busy")

    async def waiting_in(name: str) -> int:
        """Messages ready in ``name``; -1 if there is no such queue (a failed passive
        declaration closes its channel: one of its own)."""
        probe = await amqp_connection.channel()
        try:
            declared = await probe.declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return -1
        count = int(declared.declaration_result.message_count)
        await probe.close()
        return count

    def subscribed() -> RabbitBroker:
        broker = RabbitBroker(RABBITMQ_URL)
        broker.subscriber(RabbitQueue(unique, declare=False))(bill)
        return broker

    try:
        async with subscribed() as broker:
            await broker.start()
            await until(lambda: runs == [1], 30)

            async def copied() -> bool:
                return await waiting_in(retry_queue) == 1

            await until(copied, 10)
        # The consumer is gone; the copy waits in the broker, the original was acked.
        assert await waiting_in(retry_queue) + await waiting_in(unique) == 1
        async with subscribed() as broker:
            await broker.start()
            await until(lambda: runs == [1, 2], 30)  # back to the work queue after 5 s
        assert await db.inbox.count_documents({"status": "done"}) == 1
    finally:
        for name in (retry_queue, unique):
            with contextlib.suppress(Exception):
                await channel.queue_delete(name)
        await channel.close()
