"""A Redis Streams consumer process SIGKILLed inside the handler, after it, or before the XACK:
another consumer of the group reclaims the entry it held, and every effect exists exactly once."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from mongo_outbox import Event
from mongo_outbox.consumers import consume_redis
from mongo_outbox.publishers import RedisStreamsPublisher
from tests.support.billing import concurrency
from tests.support.crash import billing
from tests.support.servers import REDIS_URL, MongoServer
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize("point", ["before_write", "after_write", "before_ack"])
@pytest.mark.parametrize("transactional", [True, False], ids=["transactional", "leased"])
async def test_killed_redis_consumer_s_entry_is_reclaimed_and_each_effect_happens_once(
    mongo: MongoServer, db: Any, unique: str, transactional: bool, point: str
) -> None:
    redis = Redis.from_url(REDIS_URL)
    stream = f"{unique}:orders"
    try:
        events = [
            Event(type="order.placed", aggregate_type="orders", aggregate_id=n) for n in range(6)
        ]
        publisher = RedisStreamsPublisher(redis, stream=stream)
        assert await publisher.publish_many(events) == [None] * len(events)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.crash.redis_consumer_process",
            mongo.uri,
            db.name,
            REDIS_URL,
            stream,
            "billing",
            "1" if transactional else "0",
            point,
            cwd=ROOT,
        )
        assert await asyncio.wait_for(process.wait(), 60) == -signal.SIGKILL
        # It died on the third entry, which it still holds: pending, owned by the dead consumer.
        (held,) = await redis.xpending_range(stream, "billing", "-", "+", 10)
        assert held["consumer"] == b"doomed"
        before = await db.invoices.count_documents({})
        assert before == (
            3 if point == "before_ack" or (point == "after_write" and not transactional) else 2
        )

        stop = asyncio.Event()
        rescuer = asyncio.create_task(
            consume_redis(
                redis,
                stream,
                "billing",
                billing(db, transactional, "none"),
                consumer="rescuer",
                claim_idle=1.0,
                batch=concurrency(mongo),
                stop=stop,
            )
        )

        async def settled() -> bool:
            done = await db.invoices.count_documents({}) == len(events)
            return done and int((await redis.xpending(stream, "billing"))["pending"]) == 0

        await until(settled, timeout=60)
        await asyncio.sleep(0.3)  # a duplicate effect would have landed by now
        stop.set()
        await asyncio.wait_for(rescuer, 10)

        invoices = await db.invoices.find().to_list(None)
        assert Counter(i["_id"] for i in invoices) == {e.id: 1 for e in events}
        records = {r["message_id"]: r for r in await db.inbox.find().to_list(None)}
        assert {r["status"] for r in records.values()} == {"done"}
        if not transactional and point != "before_ack":
            # The dead consumer's claim ran out its lease; the handler ran again as attempt 2.
            assert records[events[2].id]["attempts"] == 2
        assert await redis.xlen(f"{stream}:dead") == 0
    finally:
        await redis.delete(stream, f"{stream}:dead")
        await redis.aclose()
