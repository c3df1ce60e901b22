"""A Redis Streams consumer (``consume_redis``) running the guarded billing handler, which
SIGKILLs its process at a chosen point on the third message it sees.

Usage: python -m tests.crash.redis_consumer_process
    URI DB REDIS_URL STREAM GROUP TRANSACTIONAL POINT
POINT: "before_write" (inside the handler), "after_write" (handler done, not committed),
"before_ack" (handled and committed, not yet acknowledged to Redis).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from pymongo import AsyncMongoClient
from redis.asyncio import Redis

import mongo_outbox.brokers.redis._entries as consumer
from mongo_outbox.consumers import consume_redis
from tests.support.crash import CRASH_ON, billing, die


class DieOnAck(consumer.PendingEntry):
    """An entry whose acknowledgement, for the n-th one, kills the process instead."""

    count = 0
    point = ""

    async def ack(self) -> None:
        DieOnAck.count += 1
        if DieOnAck.point == "before_ack" and DieOnAck.count == CRASH_ON:
            die()
        await super().ack()


async def main(
    uri: str, db_name: str, url: str, stream: str, group: str, transactional: bool, point: str
) -> None:
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    guarded = billing(client[db_name], transactional, point)
    DieOnAck.point = point
    consumer.PendingEntry = DieOnAck  # type: ignore[misc]
    redis = Redis.from_url(url)
    # A claim_idle longer than the test: the entries it took are reclaimed by the test's own
    # consumer, not by this one. One entry at a time: the emulator cannot run transactions
    # side by side (see tests/integration/inbox/test_inbox_consumers.concurrency).
    await consume_redis(redis, stream, group, guarded, consumer="doomed", claim_idle=3600, batch=1)
    raise SystemExit("the consumer stopped without reaching its crash point")


if __name__ == "__main__":
    uri, db_name, url, stream, group, transactional, point = sys.argv[1:]
    asyncio.run(main(uri, db_name, url, stream, group, transactional == "1", point))
