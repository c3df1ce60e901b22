"""Publish throughput of RedisStreamsPublisher, driven as the relay drives it, against redis-py
used directly: one pipeline of XADDs for the whole run (the fastest a client can go), and one
XADD per call with as many in flight as the relay allows. Same events, same MAXLEN ~ trimming,
same Redis (``REDIS_URL``); runs alternate, each on a stream of its own, deleted afterwards."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from benchmarks.bench_publishers import Run, compare, relay_driver
from benchmarks.common import client, header, standalone, unique
from mongo_outbox import Event

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
MAXLEN = 100_000
CALLS_IN_FLIGHT = 64  # under redis-py's default pool of 100 connections, one per call in flight


async def run(uri: str) -> list[str]:
    from redis.asyncio import Redis

    from mongo_outbox.brokers.redis.publisher import entry_of
    from mongo_outbox.publishers import RedisStreamsPublisher

    header(f"Redis Streams publish throughput ({REDIS_URL})")
    redis: Any = Redis.from_url(REDIS_URL)
    mongo = client(uri)
    streams: list[str] = []

    def stream() -> str:
        streams.append(unique("bench-redis-"))
        return streams[-1]

    async def library() -> Run:
        return relay_driver(RedisStreamsPublisher(redis, stream=stream(), maxlen=MAXLEN), mongo)

    async def raw_pipeline() -> Run:
        name = stream()

        async def send(events: list[Event]) -> None:
            entries = [entry_of(e) for e in events]  # serialised beforehand: the client alone
            pipeline = redis.pipeline(transaction=False)
            for fields in entries:
                pipeline.xadd(name, fields, maxlen=MAXLEN, approximate=True)
            await pipeline.execute()

        return send

    async def raw_calls() -> Run:
        name = stream()

        async def send(events: list[Event]) -> None:
            entries = [entry_of(e) for e in events]

            slots = asyncio.Semaphore(CALLS_IN_FLIGHT)

            async def one(fields: dict[str, str]) -> None:
                async with slots:
                    await redis.xadd(name, fields, maxlen=MAXLEN, approximate=True)

            await asyncio.gather(*map(one, entries))

        return send

    async def cleanup() -> None:
        try:
            if streams:
                await redis.delete(*streams)
        finally:
            await redis.aclose()
            await mongo.close()

    return await compare(
        "redis",
        {
            "library": library,
            "raw redis-py pipeline, every XADD in one": raw_pipeline,
            f"raw redis-py xadd, {CALLS_IN_FLIGHT} in flight": raw_calls,
        },
        cleanup,
    )


if __name__ == "__main__":
    standalone(run)
