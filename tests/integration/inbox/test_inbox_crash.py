"""A consumer process SIGKILLed inside the handler, after it, or before the ack: after a
restart, every event's effect exists exactly once."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from mongo_outbox import Backoff, Event
from mongo_outbox.brokers.rabbitmq._retry_queues import retry_buckets
from mongo_outbox.consumers import consume_rabbitmq
from mongo_outbox.publishers import RabbitMQPublisher
from tests.support.crash import billing
from tests.support.servers import RABBITMQ_URL, MongoServer

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("point", ["before_write", "after_write", "before_ack"])
@pytest.mark.parametrize("transactional", [True, False], ids=["transactional", "leased"])
async def test_killed_consumer_applies_each_effect_once(
    mongo: MongoServer,
    db: Any,
    amqp_connection: Any,
    unique: str,
    transactional: bool,
    point: str,
) -> None:
    channel = await amqp_connection.channel()
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(unique, durable=True)
    await queue.bind(exchange, "#")
    events = [Event(type="order.placed", aggregate_type="orders", aggregate_id=n) for n in range(6)]
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    for event in events:
        await publisher.publish(event)
    await publisher.aclose()

    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.crash.consumer_process",
        mongo.uri,
        db.name,
        unique,
        "1" if transactional else "0",
        point,
        cwd=ROOT,
    )
    assert await asyncio.wait_for(process.wait(), 60) == -signal.SIGKILL
    before = await db.invoices.count_documents({})
    # Killed on the third message: two were done; the third is done only if it died before
    # the ack (or, without transactions, after its write).
    assert before == (
        3 if point == "before_ack" or (point == "after_write" and not transactional) else 2
    )

    await channel.set_qos(prefetch_count=8)  # the restarted consumer handles several at once
    stop = asyncio.Event()
    restarted = asyncio.create_task(
        consume_rabbitmq(queue, billing(db, transactional, "none"), stop=stop)
    )
    for _ in range(400):
        # Every message done, not only every invoice written: a message whose ghost claim is
        # still leased waits in a retry queue while the others go past it.
        done = await db.inbox.count_documents({"status": "done"})
        if done == len(events) and await db.invoices.count_documents({}) == len(events):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # a duplicate effect would have landed by now
    stop.set()
    await asyncio.wait_for(restarted, 10)

    invoices = await db.invoices.find().to_list(None)
    assert Counter(i["_id"] for i in invoices) == {e.id: 1 for e in events}
    records = {r["message_id"]: r for r in await db.inbox.find().to_list(None)}
    assert {r["status"] for r in records.values()} == {"done"}
    crashed = events[2].id
    if not transactional and point != "before_ack":
        # The ghost claim ran out its lease and the handler ran again, told it was attempt 2.
        assert records[crashed]["attempts"] == 2
    assert await queue.get(fail=False, timeout=1) is None
    for ms in retry_buckets(Backoff()):  # consume_rabbitmq declared them
        await channel.queue_delete(f"{unique}.retry.{ms}")
    await queue.delete()
    await exchange.delete()
    await channel.close()
