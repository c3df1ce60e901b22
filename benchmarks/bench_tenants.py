"""TenantRelays through the command line: does one database's backlog starve the others?

``mongo-outbox relay --databases A,B,C`` runs as an operator runs it (a process of its own,
publishing to the real NATS), in each of the four configurations: change-stream and polling
relays, collection and embedded modes. B and C trickle (an event each every ``SPACING`` s)
while A drains a backlog of ``BACKLOG`` events; the figures are B's and C's commit-to-broker
latencies (the save's return to the message's arrival on a NATS subscription), beside A's
backlog and, in the same run, without it (A idle): p50, max, and their ratio.

Before rounds were bounded by time (issue 36), change streams, embedded mode: B's and C's p50
3.3 s, max 6.3 s beside the backlog against 14 ms without it, as reported; 8.8 s and 16 s
against 56 ms in this benchmark's first run. On the emulator most of it is the emulator's: it
serves one command at a time, and took 6 s for a settle of 100 documents (see
``mongo_outbox/_relay/turns.py``). The polling relay idles ``POLL_INTERVAL`` between rounds.

Measured with rounds bounded by time, on the emulator of a loaded machine (load 13-17 on two
cores), B's and C's p50 / max beside the backlog: change streams 0.31 s / 0.47 s (collection
mode; 1.99 s / 10.0 s before, same machine) and 0.30 s / 0.79 s (embedded); polling 0.08 s /
1.04 s and 0.18 s / 0.94 s. The backlog drains more slowly meanwhile (213 events published
during the trickle against 588 before, change streams, collection mode).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import NATS_URL, client, header, say, standalone, unique
from mongo_outbox import Event, Outbox

BACKLOG = 5000
DOCUMENTS = 1000  # A's backlog: BACKLOG // DOCUMENTS events in each of its orders
TRICKLE = 20  # events B and C each save while A drains
SPACING = 0.25
POLL_INTERVAL = 0.1  # the polling relay's idle wait: what a trickle waits for at the least
CONFIGURATIONS = [
    (kind, mode) for kind in ("changestream", "polling") for mode in ("collection", "embedded")
]


class Arrivals:
    """When each event reached NATS (monotonic seconds), by event id, from a subscription."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    async def note(self, msg: Any) -> None:
        event_id = (msg.headers or {}).get("Nats-Msg-Id")
        if event_id is not None:
            self.at.setdefault(event_id, time.monotonic())

    async def wait(self, ids: set[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not ids <= self.at.keys():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True


def outbox_of(db: Any, mode: str) -> Outbox:
    return Outbox(db, mode="embedded", collections=["orders"]) if mode == "embedded" else Outbox(db)


async def save(outbox: Outbox, db: Any, key: str, events: list[Event]) -> list[str]:
    saved = await outbox.save_with_events(None, db.orders, {"_id": key}, events)
    return [e.id for e in saved.events]


async def trickle(outbox: Outbox, db: Any, committed: dict[str, float]) -> None:
    for n in range(TRICKLE):
        (event_id,) = await save(outbox, db, f"t{n}", [Event(type="trickled")])
        committed[event_id] = time.monotonic()
        await asyncio.sleep(SPACING)


async def scenario(
    uri: str, mongo: Any, nc: Any, kind: str, mode: str, backlog: int
) -> tuple[list[float], int]:
    """B's and C's commit-to-broker latencies (seconds) with A's ``backlog`` draining beside
    them, and how many of A's events reached the broker by the time the trickle had."""
    names = [unique("tenant") for _ in range(3)]
    dbs = [mongo[name] for name in names]
    outboxes = [outbox_of(db, mode) for db in dbs]
    stream = unique("tenants")
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[f"{stream}.>"])
    arrivals = Arrivals()
    subscription = await nc.subscribe(f"{stream}.>", cb=arrivals.note)
    log = tempfile.TemporaryFile()  # noqa: SIM115 - the relay's output, read if it fails
    process = None
    try:
        for outbox in outboxes:
            await outbox.ensure_indexes()
        per_order = backlog // DOCUMENTS
        for start in range(0, DOCUMENTS if backlog else 0, 50):
            await asyncio.gather(
                *(
                    save(
                        outboxes[0],
                        dbs[0],
                        f"a{n}",
                        [Event(type="backlog") for _ in range(per_order)],
                    )
                    for n in range(start, start + 50)
                )
            )
        args = [
            f"--uri={uri}",
            "--databases=" + ",".join(names),
            f"--mode={mode}",
            "--collections=orders",
            f"--nats={NATS_URL}",
            f"--subject={stream}.{{type}}",
        ]
        if kind == "polling":
            args += ["--polling", f"--interval={POLL_INTERVAL}"]
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mongo_outbox", "relay", *args, stdout=log, stderr=log
        )
        # Under way once B's and C's first events arrived (A's backlog drains meanwhile).
        first: set[str] = set()
        for outbox, db in zip(outboxes[1:], dbs[1:], strict=True):
            first.update(await save(outbox, db, "w", [Event(type="warm")]))
        if not await arrivals.wait(first, 120):
            log.seek(0)
            raise RuntimeError(f"the relay published nothing: {log.read().decode()[-2000:]}")
        committed: dict[str, float] = {}
        await asyncio.gather(
            *(trickle(o, db, committed) for o, db in zip(outboxes[1:], dbs[1:], strict=True))
        )
        await arrivals.wait(set(committed), 120)
        drained = sum(1 for i in arrivals.at if i not in committed and i not in first)
    finally:
        if process is not None:
            if process.returncode is None:
                process.terminate()
            await asyncio.wait_for(process.wait(), 30)
        log.close()
        await subscription.unsubscribe()
        await js.delete_stream(stream)
        for name in names:
            await mongo.drop_database(name)
    latencies = [arrivals.at[i] - t for i, t in committed.items() if i in arrivals.at]
    return latencies, drained


def figures(latencies: list[float]) -> tuple[float, float]:
    if not latencies:
        return float("nan"), float("nan")
    return statistics.median(latencies), max(latencies)


async def run(uri: str) -> list[str]:
    import nats

    header(
        f"Tenants through the CLI: B and C trickle ({TRICKLE} events each, "
        f"{SPACING * 1000:.0f} ms apart) while A drains {BACKLOG} events, NATS"
    )
    mongo = client(uri)
    nc = await nats.connect(NATS_URL)
    lines = []
    try:
        for kind, mode in CONFIGURATIONS:
            alone, _ = await scenario(uri, mongo, nc, kind, mode, 0)
            beside, drained = await scenario(uri, mongo, nc, kind, mode, BACKLOG)
            (p50a, maxa), (p50b, maxb) = figures(alone), figures(beside)
            line = (
                f"{kind:12} {mode:10}  without backlog p50 {p50a:6.3f} s max {maxa:6.3f} s  "
                f"beside it p50 {p50b:6.3f} s max {maxb:6.3f} s  "
                f"(x{p50b / p50a:.1f} p50, x{maxb / maxa:.1f} max; "
                f"{len(beside)}/{2 * TRICKLE} arrived, A published {drained} meanwhile)"
            )
            say(line)
            lines.append(line)
    finally:
        await nc.close()
        await mongo.close()
    return lines


if __name__ == "__main__":
    only = os.environ.get("BENCH_TENANTS")  # e.g. "changestream/embedded"
    if only:
        CONFIGURATIONS[:] = [tuple(only.split("/"))]  # type: ignore[list-item]
    standalone(run)
