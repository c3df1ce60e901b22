"""Commit-to-broker-ack latency: ChangeStreamRelay against PollingRelay at its default interval,
on the same MongoDB and the same NATS server; and sustained events/s to each broker, as a ratio
of raw pipelined publishing to the same exchange or stream, measured in the same run.

Both relays talk to the server of the run through PyMongo: a replica set (MONGODB_URI), or the
tests' mongoeco emulator, whose change-stream shim serves PyMongo's own watch().
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from benchmarks.bench_publishers import bounded, make_events
from benchmarks.common import NATS_URL, RABBITMQ_URL, client, header, say, standalone, unique
from mongo_outbox import ChangeStreamRelay, Event, Outbox, PollingRelay, Saved
from mongo_outbox._steps import run_async
from mongo_outbox.publishers import NatsPublisher, Publisher, RabbitMQPublisher

EVENTS = 100
SPACING = 0.02  # seconds between commits
SUSTAINED = 500

Send = Callable[[Event], Awaitable[Any]]


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


async def commit(outbox: Outbox, orders: Any, n: int, emulated: bool) -> Any:
    """Save one order with one event. On a real server: save_with_events. On the emulator, the
    same two writes without the transaction: there a transaction committing while the relay
    writes to the outbox fails with unlabelled per-collection conflicts (see docs/testing.md),
    and what is measured here is the relay's path from commit to broker ack."""
    event = [Event(type="t")]
    if not emulated:
        return await outbox.save_with_events(None, orders, {"_id": n}, event)
    plan = outbox._rules.save(None, orders, {"_id": n}, event, None)
    return Saved(*await run_async(outbox._write(plan, None)))


async def latency(mongo: Any, kind: str, emulated: bool) -> list[float]:
    import nats

    name = unique("benchcs")
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    db = mongo[name]
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    clock = AckClock(NatsPublisher(js, subject=f"{name}.{{type}}"))
    relay: Any
    if kind == "change stream":
        relay = ChangeStreamRelay(outbox, clock, name=name, max_wait=0.005)
    else:
        relay = PollingRelay(outbox, clock)  # default interval: 1 s
    task = asyncio.create_task(relay.run())
    await asyncio.sleep(0.3)  # let it settle into its steady state
    committed: dict[str, float] = {}
    try:
        for n in range(EVENTS):
            saved = await commit(outbox, db.orders, n, emulated)
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
        await mongo.drop_database(name)
    return [(clock.acked[i] - t) * 1000 for i, t in committed.items() if i in clock.acked]


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def raw_rate(send: Send) -> float:
    """Messages/s of the broker client by hand: SUSTAINED messages, 256 in flight."""
    events = make_events(SUSTAINED)
    start = time.perf_counter()
    await bounded(len(events), lambda i: send(events[i]))
    return SUSTAINED / (time.perf_counter() - start)


async def sustained(mongo: Any, broker: str, emulated: bool) -> tuple[float, float]:
    """(events/s from a backlog of saved events to the broker through the change-stream relay's
    publishing path, end to end; raw pipelined messages/s to the same broker target)."""
    name = unique("benchcs")
    db = mongo[name]
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    for n in range(SUSTAINED):
        await commit(outbox, db.orders, n, emulated)
    publisher: Publisher
    send: Send
    cleanup: Any
    if broker == "nats":
        import nats

        nc = await nats.connect(NATS_URL)
        js = nc.jetstream()
        await js.add_stream(name=name, subjects=[f"{name}.>"])
        publisher = NatsPublisher(js, subject=f"{name}.{{type}}")

        def send(e: Event) -> Awaitable[Any]:
            return js.publish(
                f"{name}.raw", e.model_dump_json().encode(), headers={"Nats-Msg-Id": e.id}
            )

        async def cleanup() -> None:
            await js.delete_stream(name)
            await nc.close()
    else:
        import aio_pika

        connection = await aio_pika.connect_robust(RABBITMQ_URL)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC)
        queue = await channel.declare_queue(name)
        await queue.bind(exchange, "#")
        publisher = RabbitMQPublisher(exchange)

        def send(e: Event) -> Awaitable[Any]:
            message = aio_pika.Message(
                e.model_dump_json().encode(),
                message_id=e.id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            return exchange.publish(message, routing_key="raw", mandatory=True)

        async def cleanup() -> None:
            await queue.delete(if_unused=False, if_empty=False)
            await exchange.delete()
            await connection.close()

    try:
        raw = await raw_rate(send)
        relay = ChangeStreamRelay(outbox, publisher, name=name)
        start = time.perf_counter()
        published = await relay.drain()
        elapsed = time.perf_counter() - start
    finally:
        await cleanup()
        await mongo.drop_database(name)
    if published != SUSTAINED:
        raise RuntimeError(f"sustained {broker}: drained {published} of {SUSTAINED}")
    return SUSTAINED / elapsed, raw


async def run(uri: str) -> list[str]:
    header(f"Commit-to-ack latency, {EVENTS} events {SPACING * 1000:.0f} ms apart, to NATS")
    mongo = client(uri)
    build = await mongo.admin.command("buildInfo")
    emulated = build.get("gitVersion") == "mongoeco"
    lines = [f"backend: {'mongoeco emulator' if emulated else 'MongoDB'} {build['version']}"]
    try:
        results = {k: await latency(mongo, k, emulated) for k in ("change stream", "polling")}
        for kind, values in results.items():
            lines.append(
                f"{kind:<14} p50 {pct(values, 50):8.1f} ms  p99 {pct(values, 99):8.1f} ms  "
                f"({len(values)}/{EVENTS} acked)"
            )
        ratio = pct(results["polling"], 50) / pct(results["change stream"], 50)
        lines.append(f"polling p50 / change stream p50 = {ratio:.1f}x (goal >= 10x)")
        for broker in ("nats", "rabbitmq"):
            rate, raw = await sustained(mongo, broker, emulated)
            lines.append(
                f"sustained {broker:<8} {rate:7,.0f} events/s end to end ({SUSTAINED} backlog), "
                f"ratio {rate / raw:.3f} of raw pipelined publishing ({raw:,.0f} msg/s)"
            )
    finally:
        await mongo.close()
    for line in lines:
        say(line)
    return lines


if __name__ == "__main__":
    standalone(run)
