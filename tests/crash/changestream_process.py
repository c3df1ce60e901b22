"""A ChangeStreamRelay process that SIGKILLs itself at a random point: right after a broker
confirmed an event (before it is marked published or checkpointed), or after a random time
(anywhere: mid-batch, mid-checkpoint, mid-sweep, while standing by).

Usage: python -m tests.crash.changestream_process URI DB MODE STREAM RELAY_NAME SEED
Publishes to the JetStream stream STREAM (subjects ``STREAM.<type>``). Needs a server that
serves change streams to other processes (a replica set, or the test emulator).
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
from typing import Any

from pymongo import AsyncMongoClient

from mongo_outbox import Backoff, ChangeStreamRelay, Outbox, RelaySettings
from mongo_outbox.publishers import NatsPublisher
from tests.support.crash import KillAfter, die
from tests.support.servers import NATS_URL


async def main(uri: str, db_name: str, mode: str, stream: str, name: str, seed: int) -> None:
    chance = random.Random(seed)
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    outbox = Outbox(client[db_name], mode=mode, collections=["orders"])  # type: ignore[arg-type]
    inner = await NatsPublisher.connect(NATS_URL, subject=f"{stream}.{{type}}")
    relay = ChangeStreamRelay(
        outbox,
        KillAfter(inner, chance.randint(1, 400)),
        name=name,
        leader_lease=1.0,
        sweep_interval=1.0,
        settings=RelaySettings(
            claim_lease=2.0,
            publish_timeout=0.5,
            batch_size=chance.choice([1, 10, 100]),
            backoff=Backoff(initial=0.05, maximum=0.5),
        ),
    )
    asyncio.get_running_loop().call_later(chance.uniform(0.5, 5.0), die)
    await relay.run()


if __name__ == "__main__":
    # Shown by pytest -s: which process led, recovered, watched, when it died.
    logging.basicConfig(level=logging.INFO, format="relay process %(process)d: %(message)s")
    uri, db_name, mode, stream, name, seed = sys.argv[1:]
    asyncio.run(main(uri, db_name, mode, stream, name, int(seed)))
