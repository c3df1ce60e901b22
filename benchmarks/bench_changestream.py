"""Commit-to-broker-ack latency: ChangeStreamRelay at its defaults against the same relay with
the batching it had before (every batch waited out ``max_wait``) and against PollingRelay at its
default interval, on the same MongoDB and the same NATS server; a burst of commits through both
change-stream batchings (events/s and batch sizes); and sustained events/s to each broker, as a
ratio of raw pipelined publishing to the same exchange or stream, measured in the same run.

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
from mongo_outbox.changestream import ChangeBatch, ChangeStream, WatchSource
from mongo_outbox.changestream.source import ENDS_STREAM
from mongo_outbox.publishers import NatsPublisher, Publisher, RabbitMQPublisher

EVENTS = 100
SPACING = 0.02  # seconds between commits
SUSTAINED = 500
BURST = 400
BURST_ROUNDS = 6
ADAPTIVE = "change stream"
FIXED = "change stream, fixed wait (before)"

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


class Batches:
    """A change source that notes each batch's size; ``fixed`` makes every batch wait out
    ``max_wait`` as the relay's batching did before it became adaptive (the baseline)."""

    def __init__(self, inner: WatchSource, *, fixed: bool) -> None:
        self.inner = inner
        self.fixed = fixed
        self.sizes: list[int] = []

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> ChangeStream:
        stream: Any = await self.inner.open(resume_after=resume_after, start_at=start_at)
        return _Noted(stream, self)

    async def cluster_time(self) -> Any:
        return await self.inner.cluster_time()


class _Noted:
    def __init__(self, stream: Any, source: Batches) -> None:
        self.stream = stream
        self.source = source

    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        if self.source.fixed:
            batch = await _fixed_wait(self.stream.stream, max_size, max_wait)
        else:
            batch = await self.stream.next_batch(max_size, max_wait)
        if batch.changes:
            self.source.sizes.append(len(batch.changes))
        return batch

    async def aclose(self) -> None:
        await self.stream.aclose()


async def _fixed_wait(stream: Any, max_size: int, max_wait: float) -> ChangeBatch:
    """The batching before: getMore after getMore until max_wait, even with changes in hand."""
    changes: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_wait
    while len(changes) < max_size and not (changes and loop.time() >= deadline):
        change = await stream.try_next()
        if change is None:
            if not stream.alive:
                changes.append({"operationType": "invalidate"})
                break
            if changes or loop.time() >= deadline:
                break
            continue
        changes.append(change)
        if change["operationType"] in ENDS_STREAM:
            break
    return ChangeBatch(changes, stream.resume_token)


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


async def latency(
    mongo: Any, kind: str, emulated: bool, count: int = EVENTS, spacing: float = SPACING
) -> tuple[list[float], float, list[int]]:
    """Commit ``count`` events ``spacing`` seconds apart with a relay of ``kind`` at its
    defaults running; returns each one's commit-to-ack milliseconds, events/s from the first
    commit to the last ack, and the change-stream batch sizes."""
    import nats

    name = unique("benchcs")
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    db = mongo[name]
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    clock = AckClock(NatsPublisher(js, subject=f"{name}.{{type}}"))
    source = Batches(WatchSource.for_outbox(outbox), fixed=kind == FIXED)
    relay: Any
    if kind == "polling":
        relay = PollingRelay(outbox, clock)  # default interval: 1 s
    else:
        relay = ChangeStreamRelay(outbox, clock, name=name, source=source)  # max_wait 50 ms
    task = asyncio.create_task(relay.run())
    await asyncio.sleep(0.3)  # let it settle into its steady state
    committed: dict[str, float] = {}
    try:
        for n in range(count):
            saved = await commit(outbox, db.orders, n, emulated)
            committed[saved.events[0].id] = time.perf_counter()
            if spacing:
                await asyncio.sleep(spacing)
        deadline = time.perf_counter() + 30
        while len(clock.acked) < count and time.perf_counter() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
        await js.delete_stream(name)
        await nc.close()
        await mongo.drop_database(name)
    acked = [(clock.acked[i] - t) * 1000 for i, t in committed.items() if i in clock.acked]
    span = max(clock.acked.values(), default=0.0) - min(committed.values())
    return acked, len(acked) / span if span > 0 else 0.0, source.sizes


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
    header(
        f"Commit-to-ack latency at the defaults (max_wait 50 ms), {EVENTS} events "
        f"{SPACING * 1000:.0f} ms apart, to NATS; then a burst of {BURST} back-to-back commits"
    )
    mongo = client(uri)
    build = await mongo.admin.command("buildInfo")
    emulated = build.get("gitVersion") == "mongoeco"
    lines = [f"backend: {'mongoeco emulator' if emulated else 'MongoDB'} {build['version']}"]
    try:
        results = {k: await latency(mongo, k, emulated) for k in (ADAPTIVE, FIXED, "polling")}
        for kind, (values, _, _) in results.items():
            lines.append(
                f"{kind:<34} p50 {pct(values, 50):8.1f} ms  p99 {pct(values, 99):8.1f} ms  "
                f"({len(values)}/{EVENTS} acked)"
            )
        adaptive = pct(results[ADAPTIVE][0], 50)
        lines.append(
            f"p50 ratio: before / now = {pct(results[FIXED][0], 50) / adaptive:.1f}x, "
            f"polling / now = {pct(results['polling'][0], 50) / adaptive:.1f}x"
        )
        # Rounds of one burst per kind, back to back, in alternating order: a burst commits at
        # the writer's pace, which whatever else runs on the machine moves from one round to
        # the next, so each round's ratio compares two bursts as close in time as can be (the
        # order alternates, so neither kind always goes first), and the median of the rounds'
        # ratios is reported. The batches are the mechanism: how many
        # claims and settles the relay made for the same commits.
        bursts: dict[str, list[tuple[list[float], float, list[int]]]] = {ADAPTIVE: [], FIXED: []}
        for r in range(BURST_ROUNDS):
            for kind in (ADAPTIVE, FIXED) if r % 2 == 0 else (FIXED, ADAPTIVE):
                bursts[kind].append(await latency(mongo, kind, emulated, BURST, 0.0))
        for kind, runs in bursts.items():
            rates = [rate for _, rate, _ in runs]
            batches = [len(sizes) for _, _, sizes in runs]
            lines.append(
                f"burst of {BURST} commits, {kind:<34} median {statistics.median(rates):5,.0f} "
                f"events/s (rounds {', '.join(f'{r:,.0f}' for r in rates)}), batches per burst "
                f"median {statistics.median(batches):.0f} (rounds "
                f"{', '.join(map(str, batches))}), p50 latency "
                f"{statistics.median(pct(values, 50) for values, _, _ in runs):.0f} ms"
            )
        ratios = [a[1] / f[1] for a, f in zip(bursts[ADAPTIVE], bursts[FIXED], strict=True)]
        lines.append(
            f"burst ratio: now / before = {statistics.median(ratios):.2f}x (median of the "
            f"rounds' ratios: {', '.join(f'{x:.2f}' for x in ratios)})"
        )
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
