"""The relay's own CPU per published event, against a relay written by hand with PyMongo and
nats-py, measured in the same run.

MongoDB runs in another process (the emulator, or ``MONGODB_URI``), so this process's
``time.process_time()`` during a drain is the relay's cost alone: the library's, or the
driver's and the broker client's for the hand-written relay. That relay does the least a relay
can: find ``BATCH`` pending entries in order, mark them claimed, publish them (``publish_async``
to NATS, or kept in a list), mark them published, with none of the library's guarantees. Each run
drains ``EVENTS`` fresh events of ``PER_AGGREGATE`` per aggregate; runs alternate baseline and
library, ``REPEATS`` times; the figures are each one's minimum and median, and the ratio of
their minima (library / hand-written: 1.00 means the library costs no more). The change-stream
relay follows an empty outbox while another process writes the events (``--seed``), so its
figure counts what it does per change: its claims are of the batches the stream brings.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo.errors import BulkWriteError

from benchmarks.common import NATS_URL, client, fresh_db, header, median, say, standalone, unique
from mongo_outbox import ChangeStreamRelay, Event, Outbox, PollingRelay, RelaySettings
from mongo_outbox._codec import encode
from mongo_outbox.brokers._publishing import message_headers
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher, Publisher

EVENTS = 3000
PER_AGGREGATE = 3
BATCH = 100
REPEATS = 3
IN_FLIGHT = 256

# One drain: given the database and the number of events due, the CPU seconds it took.
Drain = Callable[[Any], Awaitable[float]]


def make_events() -> list[Event]:
    return [
        Event(
            type="order.placed",
            payload={"order": n, "customer": f"customer-{n % 97}", "lines": [1, 2, 3] * 8},
            aggregate_type="orders",
            aggregate_id=f"order-{n // PER_AGGREGATE}",
            sequence=n % PER_AGGREGATE + 1,
        )
        for n in range(EVENTS)
    ]


async def seed(db: Any, mode: str) -> Outbox:
    """``EVENTS`` due events, as the outbox stores them. Collection mode inserts its entries
    directly (the write side is not measured here); embedded mode saves its documents."""
    outbox = (
        Outbox(db, mode="embedded", collections=["orders"]) if mode == "embedded" else Outbox(db)
    )
    await outbox.ensure_indexes()
    if mode == "stream":  # written during the run, by seed_elsewhere
        return outbox
    events = make_events()
    if mode == "collection":
        now = utc_now()
        pending = {"status": "pending", "available_at": now, "attempts": 0}
        entries = [encode(e, "_id") | pending for e in events]
        for start in range(0, EVENTS, 500):  # commands the emulator answers quickly
            try:
                await outbox.collection.insert_many(entries[start : start + 500], ordered=False)
            except BulkWriteError as error:
                # A slow answer retried (retryable writes) finds its first try's entries.
                if any(e.get("code") != 11000 for e in error.details.get("writeErrors", [])):
                    raise
        if await outbox.collection.count_documents({}) != EVENTS:
            raise RuntimeError("the outbox was not seeded whole")
        return outbox
    for start in range(0, EVENTS, PER_AGGREGATE):
        group = [
            Event(type=e.type, payload=e.payload) for e in events[start : start + PER_AGGREGATE]
        ]
        await outbox.save_with_events(None, db.orders, {"_id": f"order-{start}"}, group)
    return outbox


def hand_written(send: Callable[[list[dict[str, Any]]], Awaitable[None]]) -> Drain:
    """The baseline: claim ``BATCH`` in order, publish them with ``send``, mark them."""

    async def drain(db: Any) -> float:
        coll = db.outbox
        start = time.process_time()
        while True:
            docs = (
                await coll.find({"status": "pending"})
                .sort("available_at", 1)
                .limit(BATCH)
                .to_list(None)
            )
            if not docs:
                break
            ids = [d["_id"] for d in docs]
            await coll.update_many({"_id": {"$in": ids}}, {"$set": {"claim": "hand"}})
            await send(docs)
            await coll.update_many(
                {"_id": {"$in": ids}},
                {"$set": {"status": "published"}, "$unset": {"claim": ""}},
            )
        return time.process_time() - start

    return drain


def library(publisher: Publisher, mode: str) -> Drain:
    async def drain(db: Any) -> float:
        outbox = (
            Outbox(db, mode="embedded", collections=["orders"])
            if mode == "embedded"
            else Outbox(db)
        )
        relay = PollingRelay(outbox, publisher, settings=RelaySettings(batch_size=BATCH))
        start = time.process_time()
        published = await relay.drain()
        took = time.process_time() - start
        if published != EVENTS:
            raise RuntimeError(f"{mode}: drained {published} of {EVENTS}")
        return took

    return drain


class Counted:
    """A batch publisher passed through, counting the events it confirmed: the end of a
    change-stream run, without asking the broker (which would cost this process CPU)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.events: list[Event] = []
        self._changed = asyncio.Condition()

    async def publish(self, event: Event) -> None:
        [error] = await self.publish_many([event])
        if error is not None:
            raise error

    async def publish_many(self, events: list[Event]) -> list[BaseException | None]:
        results: list[BaseException | None] = await self.inner.publish_many(events)
        async with self._changed:
            self.events += [e for e, r in zip(events, results, strict=True) if r is None]
            self._changed.notify_all()
        return results

    async def wait_for(self, count: int, timeout: float) -> None:
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: len(self.events) >= count), timeout
            )

    async def aclose(self) -> None:
        await self.inner.aclose()


def change_stream(uri: str, make: Callable[[], Any] = MemoryPublisher) -> Drain:
    """The change-stream relay following an empty outbox while another process inserts
    ``EVENTS`` entries (so the writes' CPU is not this process's): the time from the first
    insert to the last event published, the relay's cost alone. ``make`` gives the publisher,
    which tells what it published (``events``, ``wait_for``)."""

    async def drain(db: Any) -> float:
        publisher = make()
        relay = ChangeStreamRelay(
            Outbox(db), publisher, name="bench", settings=RelaySettings(batch_size=BATCH)
        )
        task = asyncio.create_task(relay.run())
        try:
            for _ in range(600):
                if (await relay.status()).state == "active":
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError("the change-stream relay did not start")
            await asyncio.sleep(1.0)  # its first sweep done, the stream open
            start = time.process_time()
            writer = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "benchmarks.bench_relay_cpu", "--seed", uri, db.name
            )
            if await writer.wait() != 0:
                raise RuntimeError("the writer process failed")
            await publisher.wait_for(EVENTS, timeout=600)
            took = time.process_time() - start
        finally:
            relay.stop()
            await task
        if len(publisher.events) != EVENTS:
            raise RuntimeError(f"change stream: published {len(publisher.events)} of {EVENTS}")
        return took

    return drain


async def seed_elsewhere(uri: str, name: str) -> None:
    """The change-stream run's writer, in a process of its own."""
    mongo = client(uri)
    try:
        await seed(mongo[name], "collection")
    finally:
        await mongo.close()


async def compare(uri: str, target: str, runs: dict[str, tuple[str, Drain]]) -> list[str]:
    seconds: dict[str, list[float]] = {label: [] for label in runs}
    mongo = client(uri)
    try:
        for _ in range(REPEATS):
            for label, (mode, drain) in runs.items():
                async with fresh_db(mongo) as db:
                    await seed(db, mode)
                    seconds[label].append(await drain(db))
    finally:
        await mongo.close()
    base = min(seconds["hand-written"])
    lines = []
    for label, values in seconds.items():
        us = [1e6 * v / EVENTS for v in values]
        ratio = "" if label == "hand-written" else f"  ratio {min(values) / base:.2f}"
        lines.append(
            f"{target:<6} {label:<22} {min(us):6.1f} µs/event (median {median(us):6.1f}), "
            f"{EVENTS / min(values):8,.0f} events per relay CPU-second{ratio}"
        )
        say(lines[-1])
    return lines


async def run(uri: str) -> list[str]:
    header(
        f"Relay CPU per event: {EVENTS} events, {PER_AGGREGATE} per aggregate, batch {BATCH}, "
        f"min and median of {REPEATS}"
    )
    say("ratio = library / hand-written relay (find, mark claimed, publish, mark published)")

    events: list[Event] = []

    async def keep(docs: list[dict[str, Any]]) -> None:
        # What a publisher is handed: Events, validated as they are read.
        events.extend(as_event(doc) for doc in docs)

    memory = MemoryPublisher()
    lines = await compare(
        uri,
        "memory",
        {
            "hand-written": ("collection", hand_written(keep)),
            "library collection": ("collection", library(memory, "collection")),
            "library embedded": ("embedded", library(memory, "embedded")),
            "library change stream": ("stream", change_stream(uri)),
        },
    )
    try:
        lines += await nats_runs(uri)
    except Exception as error:  # noqa: BLE001 - NATS down must not stop the rest
        lines.append(f"nats: FAILED ({error!r})")
        say(lines[-1])
    return lines


async def nats_runs(uri: str) -> list[str]:
    import nats

    from mongo_outbox.publishers import NatsPublisher

    nc = await nats.connect(NATS_URL, connect_timeout=5, max_reconnect_attempts=1)
    js = nc.jetstream(publish_async_max_pending=IN_FLIGHT)
    name = unique("bench")
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    subject = f"{name}.orders.order.placed"

    async def publish(docs: list[dict[str, Any]]) -> None:
        # As the library sends them: the event's JSON, its headers, deduplicated by id.
        acks = []
        for doc in docs:
            event = as_event(doc)
            headers = message_headers(event) | {
                "Nats-Msg-Id": event.id,
                "Content-Type": "application/json",
            }
            body = event.model_dump_json().encode()
            acks.append(await js.publish_async(subject, body, headers=headers))
        await asyncio.gather(*acks)

    publisher = NatsPublisher(js, subject=f"{name}.{{aggregate_type}}.{{type}}")
    try:
        return await compare(
            uri,
            "nats",
            {
                "hand-written": ("collection", hand_written(publish)),
                "library collection": ("collection", library(publisher, "collection")),
                "library embedded": ("embedded", library(publisher, "embedded")),
                "library change stream": ("stream", change_stream(uri, lambda: Counted(publisher))),
            },
        )
    finally:
        try:
            await js.delete_stream(name)
        finally:
            await nc.close()


def as_event(doc: dict[str, Any]) -> Event:
    fields = {k: v for k, v in doc.items() if k not in _NOT_EVENT}
    return Event(**fields, id=doc["_id"])


# The bookkeeping fields an entry carries beside the event's: the hand-written relay drops them.
_NOT_EVENT = frozenset({"_id", "status", "available_at", "attempts", "claim"})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--seed"]:
        asyncio.run(seed_elsewhere(sys.argv[2], sys.argv[3]))
    else:
        standalone(run)
