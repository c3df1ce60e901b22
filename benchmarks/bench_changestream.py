"""Commit-to-broker-ack latency: ChangeStreamRelay against PollingRelay at its default interval,
on the same MongoDB and the same NATS stream; and sustained events/s to each broker.

The change stream needs a server that serves one: here that is mongoeco's in-process client
behind its wire server (started in this process; the pymongo client writes through the wire),
since the emulator in a separate process serves no change streams. With MONGODB_URI set to a
replica set, PyMongo's own watch() is used against it instead.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import NATS_URL, RABBITMQ_URL, ROOT, header, say, unique
from mongo_outbox import ChangeStreamRelay, Event, Outbox, PollingRelay
from mongo_outbox.publishers import NatsPublisher, Publisher, RabbitMQPublisher

EVENTS = 100
SPACING = 0.02  # seconds between commits
SUSTAINED = 500


class AckClock:
    """Publishes through ``inner`` and notes when each event's confirmation arrived."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.acked: dict[str, float] = {}

    async def publish(self, event: Event) -> None:
        await self.inner.publish(event)
        self.acked.setdefault(event.id, time.perf_counter())

    async def publish_many(self, events: Sequence[Event]) -> list[BaseException | None]:
        results: list[BaseException | None] = await self.inner.publish_many(events)
        now = time.perf_counter()
        for event, error in zip(events, results, strict=True):
            if error is None:
                self.acked.setdefault(event.id, now)
        return results

    async def aclose(self) -> None:
        await self.inner.aclose()


async def server() -> tuple[Any, Any, Any]:
    """(pymongo client, change source factory, closer) for the backend in use."""
    from pymongo import AsyncMongoClient

    uri = os.environ.get("MONGODB_URI")
    if uri:
        from mongo_outbox.changestream import WatchSource

        client: Any = AsyncMongoClient(uri, tz_aware=True)
        return client, WatchSource.for_outbox, client.close
    import mongoeco
    from mongoeco.wire import AsyncMongoEcoProxyServer

    from tests.changestream_sources import MongoEcoSource  # the repo root is on sys.path

    eco = mongoeco.AsyncMongoClient()
    proxy = AsyncMongoEcoProxyServer(client=eco)
    await proxy.start()
    client = AsyncMongoClient(
        f"mongodb://127.0.0.1:{proxy.address.port}/?directConnection=true", tz_aware=True
    )

    async def close() -> None:
        await client.close()
        await proxy.close()

    return client, lambda outbox: MongoEcoSource(eco[outbox.db.name].outbox), close


async def commit(outbox: Outbox, orders: Any, n: int) -> Any:
    """Save one order with one event. On a replica set: save_with_events. On the in-process
    emulator, the same two writes without the transaction: there a transaction committing while
    the relay writes to the outbox deadlocks or fails with unlabelled conflicts (see
    docs/testing.md), and what is measured here is the relay's path from commit to broker ack."""
    event = [Event(type="t")]
    if os.environ.get("MONGODB_URI"):
        return await outbox.save_with_events(None, orders, {"_id": n}, event)
    return await outbox._write(outbox._plan(None, orders, {"_id": n}, event, None), None)


async def latency(client: Any, source_for: Any, kind: str) -> list[float]:
    import nats

    name = unique("benchcs")
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    db = client[name]
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    clock = AckClock(NatsPublisher(js, subject=f"{name}.{{type}}"))
    relay: Any
    if kind == "change stream":
        relay = ChangeStreamRelay(
            outbox, clock, name=name, source=source_for(outbox), max_wait=0.005
        )
    else:
        relay = PollingRelay(outbox, clock)  # default interval: 1 s
    task = asyncio.create_task(relay.run())
    await asyncio.sleep(0.3)  # let it settle into its steady state
    committed: dict[str, float] = {}
    try:
        for n in range(EVENTS):
            saved = await commit(outbox, db.orders, n)
            committed[saved.events[0].id] = time.perf_counter()
            await asyncio.sleep(SPACING)
        deadline = time.perf_counter() + 10
        while len(clock.acked) < EVENTS and time.perf_counter() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
        await js.delete_stream(name)
        await nc.close()
        await client.drop_database(name)
    return [(clock.acked[i] - t) * 1000 for i, t in committed.items() if i in clock.acked]


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def sustained(client: Any, source_for: Any, broker: str) -> float:
    """Events/s from a backlog of saved events to the broker through the change-stream relay's
    publishing path (its sweep), end to end."""
    name = unique("benchcs")
    db = client[name]
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    for n in range(SUSTAINED):
        await commit(outbox, db.orders, n)
    publisher: Publisher
    cleanup: Any
    if broker == "nats":
        import nats

        nc = await nats.connect(NATS_URL)
        await nc.jetstream().add_stream(name=name, subjects=[f"{name}.>"])
        publisher = NatsPublisher(nc.jetstream(), subject=f"{name}.{{type}}")

        async def cleanup() -> None:
            await nc.jetstream().delete_stream(name)
            await nc.close()
    else:
        import aio_pika

        connection = await aio_pika.connect_robust(RABBITMQ_URL)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC)
        queue = await channel.declare_queue(name)
        await queue.bind(exchange, "#")
        publisher = RabbitMQPublisher(exchange)

        async def cleanup() -> None:
            await queue.delete(if_unused=False, if_empty=False)
            await exchange.delete()
            await connection.close()

    relay = ChangeStreamRelay(outbox, publisher, name=name, source=source_for(outbox))
    start = time.perf_counter()
    published = await relay.drain()
    elapsed = time.perf_counter() - start
    await cleanup()
    await client.drop_database(name)
    assert published == SUSTAINED, published
    return SUSTAINED / elapsed


async def run(uri: str) -> list[str]:
    header(f"Commit-to-ack latency, {EVENTS} events {SPACING * 1000:.0f} ms apart, to NATS")
    client, source_for, close = await server()
    backend = (
        "MONGODB_URI" if os.environ.get("MONGODB_URI") else "mongoeco in-process (change streams)"
    )
    lines = [f"backend: {backend}"]
    try:
        results = {k: await latency(client, source_for, k) for k in ("change stream", "polling")}
        for kind, values in results.items():
            lines.append(
                f"{kind:<14} p50 {pct(values, 50):8.1f} ms  p99 {pct(values, 99):8.1f} ms  "
                f"({len(values)}/{EVENTS} acked)"
            )
        ratio = pct(results["polling"], 50) / pct(results["change stream"], 50)
        lines.append(f"polling p50 / change stream p50 = {ratio:.1f}x (goal >= 10x)")
        for broker in ("nats", "rabbitmq"):
            rate = await sustained(client, source_for, broker)
            lines.append(
                f"sustained {broker:<8} {rate:7.0f} events/s end to end ({SUSTAINED} backlog; "
                "bounded by the database: compare the raw baselines in bench_publishers)"
            )
    finally:
        await close()
    for line in lines:
        say(line)
    return lines


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    asyncio.run(run(""))
