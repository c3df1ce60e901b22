"""A FastStream Redis stream subscriber whose handler SIGKILLs its process mid-handler: what
FastStream leaves behind for an entry whose handler never finished.

Usage: python -m tests.crash.faststream_redis_process REDIS_URL STREAM GROUP CONSUMER
"""

from __future__ import annotations

import asyncio
import sys

from faststream.redis import RedisBroker, StreamSub

from tests.support.crash import die


async def main(url: str, stream: str, group: str, consumer: str) -> None:
    broker = RedisBroker(url)

    @broker.subscriber(stream=StreamSub(stream, group=group, consumer=consumer))
    async def handle(body: str) -> None:
        die()  # the handler started and never finished

    await broker.start()
    await asyncio.sleep(60)
    raise SystemExit("the subscriber got no entry")


if __name__ == "__main__":
    url, stream, group, consumer = sys.argv[1:]
    asyncio.run(main(url, stream, group, consumer))
