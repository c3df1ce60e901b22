"""A RelayGroup member process, SIGKILLed by its test at a random moment.

Usage: python -m tests.crash.group_process URI DB STREAM RECORD SEED SOURCE MODE
Publishes the MODE (collection or embedded) outbox of ``orders`` (``partitions=4``) to the
JetStream stream STREAM (subjects ``STREAM.<type>``), and appends one line per confirmed
publish to RECORD: event id, partition, member, the fence its member held when the publish
started (None if it held none) and the start and end times, so the test can check that no two
members published one partition at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
from typing import Any

from pymongo import AsyncMongoClient

from mongo_outbox import Backoff, Event, Outbox, RelayGroup, RelaySettings
from mongo_outbox.publishers import NatsPublisher, Publisher
from tests.support.servers import NATS_URL

PARTITIONS = 4
LEASE = 3.0


class Recording:
    """Publishes through ``inner``; records each confirmed publish with its member's fence."""

    def __init__(self, inner: Publisher, record: Any) -> None:
        self.inner = inner
        self.record = record
        self.group: RelayGroup | None = None

    async def publish(self, event: Event) -> None:
        assert self.group is not None
        k = self.group.outbox.partition_of(event.aggregate_type, event.aggregate_id)
        fence, started = self.group.fence(k), time.time()
        await self.inner.publish(event)
        line = {
            "id": event.id,
            "partition": k,
            "member": self.group.member,
            "fence": fence,
            "start": started,
            "end": time.time(),
        }
        # Written whole in one call (a SIGKILL may cut a line short: the test skips those).
        self.record.write(json.dumps(line) + "\n")
        self.record.flush()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def main(
    uri: str, db_name: str, stream: str, record: Any, seed: int, source: str, mode: str
) -> None:
    chance = random.Random(seed)
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    outbox = Outbox(client[db_name], mode=mode, collections=["orders"], partitions=PARTITIONS)  # type: ignore[arg-type]
    inner = await NatsPublisher.connect(NATS_URL, subject=f"{stream}.{{type}}")
    publisher = Recording(inner, record)
    group = RelayGroup(
        outbox,
        publisher,
        name="orders-group",
        source=source,  # type: ignore[arg-type]
        member_lease=LEASE,
        interval=0.05,
        settings=RelaySettings(
            claim_lease=2.0,
            publish_timeout=0.5,
            batch_size=chance.choice([5, 20, 100]),
            backoff=Backoff(initial=0.05, maximum=0.5),
        ),
    )
    publisher.group = group
    await group.run()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="member %(process)d: %(message)s")
    uri, db_name, stream, record_path, seed, source, mode = sys.argv[1:]
    with open(record_path, "a", encoding="utf-8") as record:
        asyncio.run(main(uri, db_name, stream, record, int(seed), source, mode))
