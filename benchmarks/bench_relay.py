"""Database round trips per published event for PollingRelay, in both outbox modes.

The relay's client carries a command listener; every command it sends while draining is counted
by name. The goal is a small constant number of commands per batch, whatever the batch size.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import CommandCounter, client, fresh_db, header, say, standalone
from mongo_outbox import Event, Outbox, PollingRelay, RelaySettings
from mongo_outbox.publishers import MemoryPublisher

AGGREGATES = 150
EVENTS_PER_AGGREGATE = 2
BATCH_SIZES = (10, 50, 100)
MODES = ("collection", "embedded")


def outbox_for(db: Any, mode: str) -> Outbox:
    return Outbox(db, mode="embedded", collections=["orders"]) if mode == "embedded" else Outbox(db)


async def seed(outbox: Outbox) -> int:
    for n in range(AGGREGATES):
        events = [
            Event(type="order.placed", payload={"n": n, "step": step})
            for step in range(EVENTS_PER_AGGREGATE)
        ]
        await outbox.save_with_events(None, outbox.db.orders, {"_id": f"o{n}", "n": n}, events)
    return AGGREGATES * EVENTS_PER_AGGREGATE


async def measure(uri: str, mode: str, batch_size: int) -> str:
    counter = CommandCounter()
    writer, monitored = client(uri), client(uri, counter)
    try:
        async with fresh_db(writer) as db:
            await outbox_for(db, mode).ensure_indexes()
            events = await seed(outbox_for(db, mode))
            publisher = MemoryPublisher()
            relay = PollingRelay(
                outbox_for(monitored[db.name], mode),
                publisher,
                settings=RelaySettings(batch_size=batch_size),
            )
            counter.reset()
            batches = published = idle = 0
            while True:
                before = counter.total
                n, more = await relay.publish_batch()
                if n:
                    batches += 1
                    published += n
                else:
                    idle += counter.total - before
                if not more:
                    break
            if published != events or len(publisher.events) != events:
                raise RuntimeError(f"{mode}: relayed {published} of {events} events")
            line = (
                f"{mode:<10} batch_size={batch_size:<4} events={published} batches={batches} "
                f"commands={counter.total} ({counter.breakdown()}, {idle} in empty rounds) "
                f"per batch={(counter.total - idle) / batches:.2f} "
                f"per event={counter.total / published:.3f}"
            )
    finally:
        await monitored.close()
        await writer.close()
    say(line)
    return line


async def run(uri: str) -> list[str]:
    header("PollingRelay: database round trips per batch and per event")
    say(
        f"{AGGREGATES} aggregates x {EVENTS_PER_AGGREGATE} events; MemoryPublisher; per batch "
        "leaves out the final empty claim; embedded mode claims batch_size documents per batch"
    )
    return [await measure(uri, mode, size) for mode in MODES for size in BATCH_SIZES]


if __name__ == "__main__":
    standalone(run)
