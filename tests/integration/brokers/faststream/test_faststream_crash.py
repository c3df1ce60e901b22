"""A FastStream consumer process SIGKILLed after the handler's write or before the ack: after a
restart, every event's effect exists exactly once."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mongo_outbox import Event
from mongo_outbox.publishers import RabbitMQPublisher
from tests.support.servers import RABBITMQ_URL, MongoServer
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[4]


def consumer(mongo: MongoServer, db: Any, queue: str, transactional: bool, point: str) -> Any:
    return asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.crash.faststream_consumer_process",
        mongo.uri,
        db.name,
        queue,
        "1" if transactional else "0",
        point,
        cwd=ROOT,
    )


@pytest.mark.parametrize("point", ["after_write", "before_ack"])
@pytest.mark.parametrize("transactional", [True, False], ids=["transactional", "leased"])
async def test_killed_faststream_consumer_applies_each_effect_once(
    mongo: MongoServer, db: Any, channel: Any, unique: str, transactional: bool, point: str
) -> None:
    queue = await channel.declare_queue(unique, durable=True)
    exchange = await channel.declare_exchange(unique, "topic", durable=True)
    await queue.bind(exchange, "#")
    events = [Event(type="order.placed", aggregate_type="orders", aggregate_id=n) for n in range(6)]
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    for event in events:
        await publisher.publish(event)
    await publisher.aclose()

    process = await consumer(mongo, db, unique, transactional, point)
    assert await asyncio.wait_for(process.wait(), 90) == -signal.SIGKILL
    before = await db.invoices.count_documents({})
    # Killed on the third message: two were done; the third only if it died before the ack
    # (or, without transactions, after its write).
    assert before == (
        3 if point == "before_ack" or (point == "after_write" and not transactional) else 2
    )

    restarted = await consumer(mongo, db, unique, transactional, "none")
    try:

        async def all_done() -> bool:
            done = await db.inbox.count_documents({"status": "done"})
            return done == len(events)

        await until(all_done, 60)
        await asyncio.sleep(0.5)  # a duplicate effect would have landed by now
    finally:
        restarted.kill()
        await restarted.wait()

    invoices = await db.invoices.find().to_list(None)
    assert Counter(i["_id"] for i in invoices) == {e.id: 1 for e in events}
    declared = await channel.declare_queue(unique, durable=True, passive=True)
    assert declared.declaration_result.message_count == 0  # every message acked
    await queue.delete(if_unused=False, if_empty=False)
