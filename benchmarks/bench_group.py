"""RelayGroup: throughput of 1, 2 and 4 member processes where publishing is the bottleneck,
as a ratio to 1 process measured in the same run; and how long the group takes to give a
SIGKILLed member's partitions to the survivor.

Each member publishes to a ``CpuPublisher``: a fake broker client that spends ``COST`` seconds
of CPU per event (as encoding, compression or TLS do in a real client) and keeps nothing, so
one process is bound by its own CPU and more processes can use more cores. The outbox (collection
mode, ``partitions=4``) is filled once the members hold their shares; the rate is taken between
10 % and 90 % of the events published. On a
2-core machine that also runs MongoDB (or the emulator), the members compete with the server
for the same cores: see docs/groups.md for the figures and why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.common import client, header, say, standalone, unique
from mongo_outbox import Event, Outbox, RelayGroup, RelaySettings

PARTITIONS = 4
EVENTS = 600
AGGREGATES = 200
COST = 0.02  # CPU seconds per publish
LEASE = 30.0
"""The members' lease while throughput is measured: on a loaded machine with the emulator, a
renewal can take seconds, and a member that misses one stands by until it takes the lease again."""
TAKEOVER_LEASE = 6.0
"""The members' lease while the takeover after a SIGKILL is measured."""


class CpuPublisher:
    """A fake broker client: ``cost`` seconds of CPU per event, then confirmed."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.published = 0

    async def publish(self, event: Event) -> None:
        end = time.thread_time() + self.cost
        while time.thread_time() < end:
            pass
        # A real client then awaits the broker's confirm: other tasks run meanwhile.
        await asyncio.sleep(0)
        self.published += 1

    async def aclose(self) -> None:
        pass


async def member(uri: str, db_name: str, lease: float) -> None:
    """One member process: relay until killed."""
    mongo = client(uri)
    outbox = Outbox(mongo[db_name], partitions=PARTITIONS)
    settings = RelaySettings(batch_size=200, max_in_flight=8, publish_timeout=2.0, claim_lease=20.0)
    group = RelayGroup(
        outbox, CpuPublisher(COST), member_lease=lease, interval=0.05, settings=settings
    )
    await group.run()


def spawn(uri: str, db_name: str, lease: float = LEASE) -> Any:
    return asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.bench_group", "member", uri, db_name, str(lease)
    )


async def fill(outbox: Outbox) -> None:
    """EVENTS pending entries in AGGREGATES aggregates, written in bulk (what is measured is
    the relays, not the writer; no transaction, so no conflict with the relays' writes)."""
    stamp = outbox.db.outbox
    entries = []
    for n in range(EVENTS):
        aggregate = n % AGGREGATES
        event = Event(type="t", aggregate_type="orders", aggregate_id=str(aggregate))
        entry = event.model_dump()
        entry["_id"] = entry.pop("id")
        entry |= {
            "sequence": n // AGGREGATES + 1,
            "status": "pending",
            "available_at": event.occurred_at,
            "attempts": 0,
            "partition": outbox.partition_of("orders", str(aggregate)),
        }
        entries.append(entry)
    for start in range(0, len(entries), 100):  # the emulator answers big inserts slowly
        await stamp.insert_many(entries[start : start + 100])


async def throughput(uri: str, processes: int) -> float:
    mongo = client(uri)
    name = unique("group")
    try:
        outbox = Outbox(mongo[name], partitions=PARTITIONS)
        await outbox.ensure_indexes()
        members = [await spawn(uri, name) for _ in range(processes)]
        try:
            # The group settles first (each member holds its share): what is measured is its
            # steady rate, not how fast it forms.
            share = sorted([PARTITIONS // processes] * processes)
            await poll(lambda: _spread(mongo[name].outbox_relays, share))
            await fill(outbox)
            marks: dict[int, float] = {}
            while 90 not in marks:
                done = await mongo[name].outbox.count_documents({"status": "published"})
                now = time.perf_counter()
                for percent in (10, 90):
                    if done >= EVENTS * percent // 100:
                        marks.setdefault(percent, now)
                await asyncio.sleep(0.1)
        finally:
            for process in members:
                process.send_signal(signal.SIGKILL)
                await process.wait()
        return EVENTS * 0.8 / (marks[90] - marks[10])
    finally:
        await mongo.drop_database(name)
        await mongo.close()


async def _spread(leases: Any, share: list[int]) -> bool:
    """Whether the live partition leases are held as ``share`` says (partitions per member)."""
    held: dict[str, int] = {}
    now = time.time()
    async for doc in leases.find({"owner": {"$ne": None}}):
        if doc["lease_until"].timestamp() > now:
            held[doc["owner"]] = held.get(doc["owner"], 0) + 1
    return sorted(held.values()) == share


async def poll(condition: Callable[[], Awaitable[bool]]) -> None:
    while True:
        if await condition():
            return
        await asyncio.sleep(0.1)


async def rebalance(uri: str) -> float:
    """Seconds from SIGKILLing one of two members until the other holds every partition."""
    mongo = client(uri)
    name = unique("group")
    try:
        outbox = Outbox(mongo[name], partitions=PARTITIONS)
        await outbox.ensure_indexes()
        members = [await spawn(uri, name, TAKEOVER_LEASE) for _ in range(2)]
        leases = mongo[name].outbox_relays
        try:

            async def settled() -> bool:
                return await _spread(leases, [2, 2])

            async def survivor_holds_all() -> bool:
                return await _spread(leases, [PARTITIONS])

            await poll(settled)
            members[0].send_signal(signal.SIGKILL)
            await members[0].wait()
            killed = time.perf_counter()
            await poll(survivor_holds_all)
            return time.perf_counter() - killed
        finally:
            for process in members:
                if process.returncode is None:
                    process.send_signal(signal.SIGKILL)
                    await process.wait()
    finally:
        await mongo.drop_database(name)
        await mongo.close()


async def run(uri: str) -> list[str]:
    header(
        f"RelayGroup: {EVENTS} events, {PARTITIONS} partitions, {COST * 1000:g} ms CPU per "
        f"publish, {os.cpu_count()} cores"
    )
    rates = {}
    for processes in (1, 2, 4):
        rates[processes] = await throughput(uri, processes)
        say(
            f"{processes} process(es): {rates[processes]:7.0f} events/s "
            f"({rates[processes] / rates[1]:.2f}x of 1 process)"
        )
    takeover = await rebalance(uri)
    say(f"takeover after SIGKILL of 1 of 2 members: {takeover:.1f} s (lease {TAKEOVER_LEASE:g} s)")
    return [
        f"1 process {rates[1]:.0f}/s; 2: {rates[2] / rates[1]:.2f}x; 4: {rates[4] / rates[1]:.2f}x",
        f"takeover after SIGKILL {takeover:.1f} s (lease {TAKEOVER_LEASE:g} s)",
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["member"]:
        # A member's lost leases and takeovers, on stderr, as the command line logs them.
        logging.basicConfig(level=logging.INFO, format="member %(process)d: %(message)s")
        asyncio.run(member(sys.argv[2], sys.argv[3], float(sys.argv[4])))
    else:
        standalone(run)
