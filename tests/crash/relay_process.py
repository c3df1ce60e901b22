"""A relay process that kills itself (SIGKILL) once KILL_AFTER events are confirmed, before it
can mark anything published: the crash a relay must survive. With KILL_AT "settle" (embedded
mode) it dies instead right after its settle marked the published ids in the event-id registry,
before it removed their entries from their documents; with KILL_AT "claim" right after its claim
took the ids for their documents in the registry (the insert of ids new to it), before it
published any, and with "retake" right after it took ids already there (the check that follows
the insert's duplicate keys).

Usage: python -m tests.crash.relay_process URI DB MODE BROKER TARGET KILL_AFTER [KILL_AT]
BROKER is "nats" (TARGET: the stream, also the subject prefix) or "rabbitmq" (TARGET: exchange).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from pymongo import AsyncMongoClient

from mongo_outbox import Outbox, PollingRelay, RelaySettings
from mongo_outbox.publishers import NatsPublisher, Publisher, RabbitMQPublisher
from tests.support.crash import KillAfter, KillAfterWrite
from tests.support.servers import NATS_URL, RABBITMQ_URL


async def main(
    uri: str, db_name: str, mode: Any, broker: str, target: str, kill_after: int, kill_at: str
) -> None:
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    outbox = Outbox(client[db_name], mode=mode, collections=["orders"])
    if kill_at == "settle":
        outbox.event_ids = KillAfterWrite(outbox.event_ids, "update_many")
    elif kill_at == "claim":
        outbox.event_ids = KillAfterWrite(outbox.event_ids, "insert_many")
    elif kill_at == "retake":
        outbox.event_ids = KillAfterWrite(outbox.event_ids, "bulk_write")
    inner: Publisher
    if broker == "nats":
        inner = await NatsPublisher.connect(NATS_URL, subject=f"{target}.{{type}}")
    else:
        inner = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=target)
    relay = PollingRelay(
        outbox,
        KillAfter(inner, kill_after),
        settings=RelaySettings(
            batch_size=100, claim_lease=2.0, publish_timeout=1.0, max_in_flight=1
        ),
    )
    await relay.drain()
    raise SystemExit("the relay finished without reaching its kill point")


if __name__ == "__main__":
    uri, db_name, mode, broker, target, kill_after = sys.argv[1:7]
    kill_at = sys.argv[7] if len(sys.argv) > 7 else "confirm"
    asyncio.run(main(uri, db_name, mode, broker, target, int(kill_after), kill_at))
