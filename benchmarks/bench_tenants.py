"""TenantRelays: does one database's backlog starve the others? Commit-to-broker latency of two
trickling databases (B and C, an event each every ``SPACING`` s) while a third (A) drains a
backlog of ``BACKLOG`` events, all three in one process (change streams, embedded mode), as a
ratio to B and C served alone, measured in the same run.

Measured before turns (``_relay.turns``): B's and C's p50 1.3 s, 21 s and 10.8 s in three runs (max
67 s), against 0.59 s alone. The goal: p50 at most 1 s with A's backlog draining. The broker is
an in-process publisher that notes when each event reached it (what the relay does, not a
broker's latency, is measured).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from benchmarks.common import client, header, say, standalone, unique
from mongo_outbox import ChangeStreamRelay, Event, Outbox, RelaySettings
from mongo_outbox.tenants import TenantRelays

BACKLOG = 5000
DOCUMENTS = 1000  # A's backlog: BACKLOG // DOCUMENTS events in each of its documents
TRICKLE = 20  # events B and C each save while A drains
SPACING = 0.25


class Clocked:
    """A publisher that notes when each event reached it (monotonic seconds)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    async def publish(self, event: Event) -> None:
        self.at.setdefault(event.id, time.monotonic())

    async def aclose(self) -> None:
        pass


def relay(outbox: Outbox, publisher: Clocked) -> ChangeStreamRelay:
    return ChangeStreamRelay(outbox, publisher, name="tenant-relay", settings=RelaySettings())


async def trickle(outbox: Outbox, db: Any, committed: dict[str, float]) -> None:
    for n in range(TRICKLE):
        saved = await outbox.save_with_events(
            None, db.carts, {"_id": f"c{n}"}, [Event(type="cart.opened")]
        )
        committed[saved.events[0].id] = time.monotonic()
        await asyncio.sleep(SPACING)


async def scenario(mongo: Any, backlog: int) -> tuple[list[float], int]:
    """B's and C's commit-to-publish latencies (seconds) with A's ``backlog`` draining beside
    them, and how many of A's events were published by the time the trickle ended."""
    names = [unique("tenant") for _ in range(3)]
    dbs = [mongo[name] for name in names]
    outboxes = [Outbox(db, mode="embedded", collections=["carts"]) for db in dbs]
    try:
        for outbox in outboxes:
            await outbox.ensure_indexes()
        per_document = backlog // DOCUMENTS
        for n in range(DOCUMENTS if backlog else 0):
            events = [Event(type="line.added", payload={"n": i}) for i in range(per_document)]
            await outboxes[0].save_with_events(None, dbs[0].carts, {"_id": f"a{n}"}, events)
        publisher = Clocked()
        relays = [relay(outbox, publisher) for outbox in (outboxes if backlog else outboxes[1:])]
        tenants = TenantRelays(relays)
        task = asyncio.ensure_future(tenants.run())
        try:
            while not all([(await r.status()).active for r in relays]):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            committed: dict[str, float] = {}
            await asyncio.gather(
                *(trickle(o, db, committed) for o, db in zip(outboxes[1:], dbs[1:], strict=True))
            )
            deadline = time.monotonic() + 120
            while not committed.keys() <= publisher.at.keys():
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            drained = len(publisher.at) - sum(1 for i in committed if i in publisher.at)
        finally:
            tenants.stop()
            await asyncio.wait_for(task, 60)
        latencies = [publisher.at[i] - t for i, t in committed.items() if i in publisher.at]
        return latencies, drained
    finally:
        for name in names:
            await mongo.drop_database(name)


def figures(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p50 = statistics.median(ordered) if ordered else float("nan")
    top = ordered[-1] if ordered else float("nan")
    return f"p50 {p50:6.2f} s  max {top:6.2f} s  ({len(ordered)}/{2 * TRICKLE} published)"


async def run(uri: str) -> list[str]:
    header(
        f"Tenants: B and C trickle ({TRICKLE} events each, {SPACING * 1000:.0f} ms apart) "
        f"while A drains {BACKLOG} events, one process, change streams, embedded mode"
    )
    mongo = client(uri)
    try:
        alone, _ = await scenario(mongo, 0)
        say(f"B and C alone:           {figures(alone)}")
        beside, drained = await scenario(mongo, BACKLOG)
        say(f"B and C beside A:        {figures(beside)}  (A published {drained} meanwhile)")
    finally:
        await mongo.close()
    ratio = statistics.median(beside) / statistics.median(alone)
    lines = [
        f"alone: {figures(alone)}",
        f"beside a {BACKLOG}-event backlog: {figures(beside)}",
        f"p50 ratio beside / alone: {ratio:.1f}x (A published {drained} meanwhile)",
    ]
    say(lines[-1])
    return lines


if __name__ == "__main__":
    standalone(run)
