"""A ``consume_rabbitmq`` consumer whose handler fails each message's first attempt, so that
every message goes through a retry queue; it SIGKILLs itself at a chosen point.

Usage: python -m tests.crash.retry_consumer_process URI DB QUEUE TRANSACTIONAL POINT
POINT: "after_copy" (the copy is confirmed in its retry queue, the original not yet acked),
"never" (runs until the test kills it).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aio_pika
from pymongo import AsyncMongoClient

from mongo_outbox import Backoff, Event, Inbox, inbox_guard
from mongo_outbox.consumers import consume_rabbitmq
from tests.support.crash import die
from tests.support.servers import RABBITMQ_URL

RETRY_DELAY = 3.0  # seconds; one retry queue, <queue>.retry.3000


def flaky_billing(db: Any, transactional: bool) -> Any:
    """Fails every message's first attempt; later attempts count a run on its invoice."""
    inbox = Inbox(db, consumer="billing", transactional=transactional, processing_lease=1.0)

    @inbox_guard(inbox, backoff=Backoff(initial=RETRY_DELAY, maximum=RETRY_DELAY))
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        if attempt == 1:
            raise ConnectionError("ledger busy")
        await db.invoices.update_one(
            {"_id": event.id}, {"$inc": {"runs": 1}}, upsert=True, session=session
        )

    return bill


class DieOnFirstAck:
    """The delivered message, except that acknowledging it kills the process. The handler fails
    every first attempt, so the first ack is the one that follows a confirmed retry copy."""

    def __init__(self, message: Any) -> None:
        self._message = message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._message, name)

    async def ack(self) -> None:
        die()


class DyingQueue:
    """The work queue, handing the consumer messages that die on their ack."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)

    async def consume(self, callback: Any) -> str:
        async def wrapped(message: Any) -> None:
            await callback(DieOnFirstAck(message))

        tag: str = await self._queue.consume(wrapped)
        return tag


async def main(uri: str, db_name: str, queue_name: str, transactional: bool, point: str) -> None:
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    connection = await aio_pika.connect_robust(RABBITMQ_URL)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=1)
    queue: Any = await channel.declare_queue(queue_name, durable=True)
    if point == "after_copy":
        queue = DyingQueue(queue)
    await consume_rabbitmq(queue, flaky_billing(client[db_name], transactional))
    raise SystemExit("the consumer stopped without being killed")


if __name__ == "__main__":
    uri, db_name, queue_name, transactional, point = sys.argv[1:]
    asyncio.run(main(uri, db_name, queue_name, transactional == "1", point))
