"""A FastStream RabbitMQ subscriber guarded by ``inbox_handler`` that SIGKILLs itself at a chosen
point on the third message it sees.

Usage: python -m tests.crash.faststream_consumer_process URI DB QUEUE TRANSACTIONAL POINT
POINT: "after_write" (handler done, not committed), "before_ack" (handled and committed, not
yet acknowledged to the broker), or "none" (never: consume until every message is handled).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from faststream.rabbit import Channel, RabbitBroker, RabbitQueue
from faststream.rabbit.message import RabbitMessage
from pymongo import AsyncMongoClient

from mongo_outbox import Event, Inbox
from mongo_outbox.faststream import inbox_handler
from tests.support.crash import CRASH_ON, die
from tests.support.servers import RABBITMQ_URL


def die_on_ack(point: str) -> None:
    """Acknowledging the CRASH_ON-th message kills the process: the crash is injected into
    FastStream's own ack, the call inbox_handler settles a handled message with."""
    acked = 0
    ack = RabbitMessage.ack

    async def dying_ack(self: RabbitMessage, multiple: bool = False) -> None:
        nonlocal acked
        if self.raw_message.locked:  # FastStream acks again after the handler: a no-op
            return
        acked += 1
        if point == "before_ack" and acked == CRASH_ON:
            die()
        await ack(self, multiple)

    RabbitMessage.ack = dying_ack  # type: ignore[method-assign]


async def main(uri: str, db_name: str, queue: str, transactional: bool, point: str) -> None:
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    db = client[db_name]
    die_on_ack(point)
    seen = 0
    inbox = Inbox(db, consumer="billing", transactional=transactional, processing_lease=1.0)

    @inbox_handler(inbox)
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        nonlocal seen
        seen += 1
        # Idempotent on the event id, as a handler without transactions must be.
        await db.invoices.update_one(
            {"_id": event.id}, {"$setOnInsert": {"attempt": attempt}}, upsert=True, session=session
        )
        if point == "after_write" and seen == CRASH_ON:
            die()

    broker = RabbitBroker(RABBITMQ_URL)
    broker.subscriber(RabbitQueue(queue, declare=False), channel=Channel(prefetch_count=1))(bill)
    async with broker:
        await broker.start()
        await asyncio.sleep(120)
    raise SystemExit("the consumer ran out of time without reaching its crash point")


if __name__ == "__main__":
    uri, db_name, queue, transactional, point = sys.argv[1:]
    asyncio.run(main(uri, db_name, queue, transactional == "1", point))
