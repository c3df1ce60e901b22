"""A RabbitMQ consumer running a guarded handler that SIGKILLs itself at a chosen point on the
third message it sees.

Usage: python -m tests.crash.consumer_process URI DB QUEUE TRANSACTIONAL POINT
POINT: "before_write" (inside the handler), "after_write" (handler done, not committed),
"before_ack" (handled and committed, not yet acknowledged to the broker).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aio_pika
from pymongo import AsyncMongoClient

from mongo_outbox.consumers import handle_rabbitmq_message
from tests.support.crash import CRASH_ON, billing, die
from tests.support.servers import RABBITMQ_URL


class DieOnAck:
    """The delivered message, except that acknowledging the n-th one kills the process."""

    count = 0

    def __init__(self, message: Any, point: str) -> None:
        self._message = message
        self._point = point

    def __getattr__(self, name: str) -> Any:
        return getattr(self._message, name)

    async def ack(self) -> None:
        DieOnAck.count += 1
        if self._point == "before_ack" and DieOnAck.count == CRASH_ON:
            die()
        await self._message.ack()


async def main(uri: str, db_name: str, queue_name: str, transactional: bool, point: str) -> None:
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    guarded = billing(client[db_name], transactional, point)
    connection = await aio_pika.connect_robust(RABBITMQ_URL)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=1)
    queue = await channel.get_queue(queue_name)
    async with queue.iterator() as messages:
        async for message in messages:
            await handle_rabbitmq_message(DieOnAck(message, point), guarded)
    raise SystemExit("the consumer finished without reaching its crash point")


if __name__ == "__main__":
    uri, db_name, queue_name, transactional, point = sys.argv[1:]
    asyncio.run(main(uri, db_name, queue_name, transactional == "1", point))
