"""RelayGroup: throughput of 1, 2 and 4 member processes where publishing is the bottleneck,
as a ratio to 1 process measured in the same round; and how long the group takes to give a
SIGKILLed member's partitions to the survivor.

Each member publishes to a ``WindowSink``: a fake broker connection that holds at most
``WINDOW`` publishes at once and confirms each ``LATENCY`` seconds after it was sent, keeping
nothing. That is what one process's connection with publisher confirms allows (a window of
unconfirmed messages, a round trip each), whatever the CPU: one member publishes at most
``WINDOW / LATENCY`` events a second, and more members bring more connections. A sink that
burns CPU instead (this benchmark's first version) measures the machine's free cores, which on
a shared 2-core machine running the emulator are none.

The sinks are slow enough that four members need at most 80 events/s: the emulator, which
writes each event twice (claimed, settled) at 2 to 7 ms a document under load, can keep up with
that, so the members' connections stay the bottleneck.

Four member processes are started once and kept; each run starts a group in ``k`` of them on
a fresh outbox (collection mode, ``partitions=4``), waits until the members hold their shares,
fills it with entries that all come due at one moment just after the fill, and times from that
moment until the last event is confirmed. The runs of 1, 2 and 4 members are interleaved, round
after round (in a rotating order), so a change in the machine's load falls on all three alike;
each round's ratios are to its own 1-member run, and the medians of the rounds are reported.

Each round also times the store by hand (``by_hand``): the same commands for the same entries
from a bare PyMongo script, no library and no sink. It is the most events a second any number
of members could move on this store, and on a loaded machine it can fall below what four
members' connections need.

Each member counts, in the benchmark only (the library is not instrumented): what its sink
confirmed per partition and how busy its window was, its claims (empty ones, and collisions:
entries found due but claimed by another member first), its MongoDB commands and the time they
took, and its partition leases (taken, lost).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from pymongo import UpdateMany
from pymongo.monitoring import (
    CommandFailedEvent,
    CommandListener,
    CommandStartedEvent,
    CommandSucceededEvent,
)

from benchmarks.common import client, header, say, standalone, unique
from mongo_outbox import Event, Outbox, RelayGroup, RelaySettings

PARTITIONS = 4
EVENTS = 120
AGGREGATES = 80
WINDOW = 2
"""Publishes one member's connection holds unconfirmed at once."""
LATENCY = 0.1
"""Seconds from a publish to its confirm: with WINDOW, 20 events/s a member at most."""
ROUNDS = 3
"""Rounds of interleaved 1-, 2- and 4-member runs; the figures are their medians."""
POOL = 4
SETTINGS = RelaySettings(batch_size=15, max_in_flight=8, publish_timeout=2.0, claim_lease=20.0)
"""Batches of 15: each partition's 30 events take two rounds or more, so a run shows claims and
settles between publishes, not only one claim at the start."""
INTERVAL = 0.1
"""How long an idle partition's worker sleeps between two claims: the delay before a run's
first claim, and the load an idle member puts on the emulator."""
LEASE = 30.0
"""The members' lease while throughput is measured: on a loaded machine with the emulator, a
renewal can take seconds, and a member that misses one stands by until it takes the lease again."""
TAKEOVER_LEASE = 6.0
"""The members' lease while the takeover after a SIGKILL is measured."""
FILL_MARGIN = 0.6
"""Seconds between the start of a fill and the moment its entries come due, at least (twice
the last fill's time if longer)."""
fills: list[float] = []
RUN_TIMEOUT = 60.0


class WindowSink:
    """A fake broker connection: at most ``window`` publishes unconfirmed at once, each
    confirmed ``latency`` seconds after it was sent. Reports each confirm on stdout."""

    def __init__(self, window: int, latency: float) -> None:
        self.latency = latency
        self.window = window
        self._slots = asyncio.Semaphore(window)
        self.per_partition: Counter[int] = Counter()
        self.busy = 0.0  # seconds of latency served, summed over the window's slots
        self.first: float | None = None
        self.last = 0.0
        self.seen: set[str] = set()
        self.duplicates = 0

    async def publish(self, event: Event) -> None:
        async with self._slots:
            sent = time.monotonic()
            self.first = sent if self.first is None else self.first
            await asyncio.sleep(self.latency)
            self.last = time.monotonic()
            self.busy += self.last - sent
        partition = int(event.headers.get("partition", -1)) if event.headers else -1
        self.per_partition[partition] += 1
        if event.id in self.seen:
            self.duplicates += 1
        self.seen.add(event.id)
        print(f"p {self.last:.6f} {event.id}", flush=True)

    async def aclose(self) -> None:
        pass


class Commands(CommandListener):
    """A member's MongoDB commands, by command and collection, with the time they took."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.seconds: dict[str, float] = {}
        self._names: dict[int, str] = {}

    def started(self, event: CommandStartedEvent) -> None:
        target = event.command.get(event.command_name)
        self._names[event.request_id] = f"{event.command_name}:{target}"

    def succeeded(self, event: CommandSucceededEvent) -> None:
        self._done(event.request_id, event.duration_micros)

    def failed(self, event: CommandFailedEvent) -> None:
        self._done(event.request_id, event.duration_micros)

    def _done(self, request: int, micros: int) -> None:
        name = self._names.pop(request, None)
        if name is not None and not name.startswith(("hello", "ismaster", "endSessions")):
            self.counts[name] += 1
            self.seconds[name] = self.seconds.get(name, 0.0) + micros / 1e6


class CountedClaims:
    """The outbox collection as a partition's store sees it, counting its claims: each claim's
    ``update_many`` names the entries found due; fewer claimed is a collision with another
    member (or relay) that claimed them first."""

    def __init__(self, coll: Any, counts: Counter[str]) -> None:
        self._coll = coll
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coll, name)

    async def update_many(self, filter: Any, update: Any, **options: Any) -> Any:
        result = await self._coll.update_many(filter, update, **options)
        if "claim" in update.get("$set", {}) and isinstance(filter.get("_id"), dict):
            found = len(filter["_id"].get("$in", ()))
            self._counts["claims"] += 1
            self._counts["claimed"] += result.modified_count
            self._counts["collided"] += found - result.modified_count
        return result

    def find(self, filter: Any, *args: Any, **options: Any) -> Any:
        if filter.get("status") == "pending" and "available_at" in filter:
            self._counts["due_queries"] += 1  # a claim's first find; empty ones end there
        return self._coll.find(filter, *args, **options)


class CountedGroup(RelayGroup):
    """A RelayGroup whose partition workers count their claims (benchmark instrumentation)."""

    counts: Counter[str]

    def _worker(self, k: int) -> Any:
        worker = super()._worker(k)
        rounds = getattr(worker, "rounds", None)
        if rounds is not None and hasattr(rounds.store, "coll"):
            rounds.store.coll = CountedClaims(rounds.store.coll, self.counts)
        return worker


class LeaseLog(logging.Handler):
    """Counts the partition leases a member took and lost, from the library's log lines."""

    def __init__(self, counts: Counter[str]) -> None:
        super().__init__(logging.INFO)
        self.counts = counts

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "taken, fence" in message:
            self.counts["leases_taken"] += 1
        elif "lease lost" in message or "lease renewal failed" in message:
            self.counts["leases_lost"] += 1


async def member(uri: str) -> None:
    """One member process: runs a group on the database each ``start`` line names, until
    ``stop``; then prints its counts as one ``stats`` line."""
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        words = line.split()
        if words[0] != "start":
            continue
        db_name, lease = words[1], float(words[2])
        commands = Commands()
        mongo = client(uri, commands)
        counts: Counter[str] = Counter()
        handler = LeaseLog(counts)
        logging.getLogger("mongo_outbox").addHandler(handler)
        sink = WindowSink(WINDOW, LATENCY)
        outbox = Outbox(mongo[db_name], partitions=PARTITIONS)
        group = CountedGroup(outbox, sink, member_lease=lease, interval=INTERVAL, settings=SETTINGS)
        group.counts = counts
        task = asyncio.ensure_future(group.run())
        await loop.run_in_executor(None, sys.stdin.readline)  # "stop"
        group.stop()
        await task
        logging.getLogger("mongo_outbox").removeHandler(handler)
        stats = {
            "partitions": dict(sorted(sink.per_partition.items())),
            "busy": sink.busy,
            "first": sink.first,
            "last": sink.last,
            "duplicates": sink.duplicates,
            "counts": dict(counts),
            "commands": dict(commands.counts),
            "db_seconds": dict(commands.seconds),
        }
        print("stats " + json.dumps(stats), flush=True)
        await mongo.close()


class Member:
    """A member process of the pool, driven through its stdin and read through its stdout."""

    def __init__(self, process: Any, confirms: asyncio.Queue[tuple[float, str]]) -> None:
        self.process = process
        self.stats: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read(confirms))

    async def _read(self, confirms: asyncio.Queue[tuple[float, str]]) -> None:
        async for raw in self.process.stdout:
            line = raw.decode()
            if line.startswith("p "):
                _, at, event_id = line.split()
                confirms.put_nowait((float(at), event_id))
            elif line.startswith("stats "):
                self.stats.put_nowait(json.loads(line[6:]))

    async def send(self, line: str) -> None:
        self.process.stdin.write(f"{line}\n".encode())
        await self.process.stdin.drain()

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
            await self.process.wait()
        self._reader.cancel()


async def spawn(uri: str, confirms: asyncio.Queue[tuple[float, str]]) -> Member:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.bench_group",
        "member",
        uri,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    return Member(process, confirms)


async def fill(outbox: Outbox, due: datetime) -> None:
    """EVENTS pending entries in AGGREGATES aggregates, due at ``due``, written in bulk (what
    is measured is the relays, not the writer). Each carries its partition in a header, for
    the sinks to count."""
    entries = []
    for n in range(EVENTS):
        aggregate = n % AGGREGATES
        partition = outbox.partition_of("orders", str(aggregate))
        event = Event(
            type="t",
            aggregate_type="orders",
            aggregate_id=str(aggregate),
            headers={"partition": str(partition)},
        )
        entry = event.model_dump()
        entry["_id"] = entry.pop("id")
        entry |= {
            "sequence": n // AGGREGATES + 1,
            "status": "pending",
            "available_at": due,
            "attempts": 0,
            "partition": partition,
        }
        entries.append(entry)
    for start in range(0, len(entries), 100):  # the emulator answers big inserts slowly
        await outbox.db.outbox.insert_many(entries[start : start + 100])


async def throughput(
    mongo: Any, pool: list[Member], confirms: asyncio.Queue[tuple[float, str]], k: int
) -> tuple[float, list[dict[str, Any]]]:
    """Events a second of ``k`` members from the moment every entry is due until the last is
    confirmed, and each member's counts."""
    name = unique("group")
    members = pool[:k]
    try:
        outbox = Outbox(mongo[name], partitions=PARTITIONS)
        await outbox.ensure_indexes()
        for m in members:
            await m.send(f"start {name} {LEASE}")
        # The group settles first (each member holds its share): what is measured is its
        # steady rate, not how fast it forms.
        share = sorted([PARTITIONS // k] * k)
        await poll(lambda: _spread(mongo[name].outbox_relays, share))
        while not confirms.empty():
            confirms.get_nowait()
        # Every entry comes due at one moment after the fill, without a write: on the
        # emulator, a write that made 160 entries due took over a second, during which the
        # members' claims waited.
        margin = max(FILL_MARGIN, 2 * fills[-1]) if fills else FILL_MARGIN
        released = time.monotonic() + margin
        filling = time.monotonic()
        await fill(outbox, _now() + timedelta(seconds=margin))
        fills.append(time.monotonic() - filling)
        if time.monotonic() > released:
            late = time.monotonic() - released
            say(f"    (the fill ended {late:.2f}s after its entries came due)")
        seen: set[str] = set()
        last = released
        deadline = released + RUN_TIMEOUT
        while len(seen) < EVENTS:
            at, event_id = await asyncio.wait_for(confirms.get(), deadline - time.monotonic())
            seen.add(event_id)
            last = max(last, at)
        for m in members:
            await m.send("stop")
        stats = [await asyncio.wait_for(m.stats.get(), 30) for m in members]
        for s in stats:
            s["released"] = released
        return EVENTS / (last - released), stats
    finally:
        await mongo.drop_database(name)


async def by_hand(mongo: Any) -> float:
    """Events a second the emulator serves when nothing else limits: the commands a group's
    rounds send (claim: find the due, mark them claimed, read their aggregates' pending
    entries; settle: one bulk write), written here with PyMongo alone, no library and no sink,
    one task per partition, on a fresh outbox filled as for the members. What the group's
    members publish can never exceed it: each event costs the store this work whoever sends it."""
    name = unique("byhand")
    try:
        outbox = Outbox(mongo[name], partitions=PARTITIONS)
        await outbox.ensure_indexes()
        coll = mongo[name].outbox
        due = _now() + timedelta(seconds=FILL_MARGIN)
        await fill(outbox, due)
        await asyncio.sleep(max(0.0, (due - _now()).total_seconds()))
        started = time.monotonic()

        async def partition(k: int) -> None:
            while True:
                now = _now()
                found = await (
                    coll.find({"partition": k, "status": "pending", "available_at": {"$lte": now}})
                    .sort("available_at", 1)
                    .limit(SETTINGS.batch_size)
                    .to_list(None)
                )
                if not found:
                    return
                token = uuid.uuid4().hex
                ids = [e["_id"] for e in found]
                await coll.update_many(
                    {"_id": {"$in": ids}, "status": "pending"},
                    {"$set": {"claim": token, "available_at": now + timedelta(seconds=20)}},
                )
                aggregates = {
                    (e["aggregate_type"], e["aggregate_id"]): e["sequence"] for e in found
                }
                await (
                    coll.find(
                        {
                            "status": "pending",
                            "$or": [
                                {"aggregate_type": t, "aggregate_id": i, "sequence": {"$lte": seq}}
                                for (t, i), seq in aggregates.items()
                            ],
                        }
                    )
                    .sort("sequence", 1)
                    .to_list(None)
                )
                await coll.bulk_write(
                    [
                        UpdateMany(
                            {"_id": {"$in": ids}},
                            {"$set": {"status": "published"}, "$unset": {"claim": ""}},
                        ),
                        UpdateMany(
                            {"claim": token, "status": "pending"},
                            {"$set": {"available_at": now}, "$unset": {"claim": ""}},
                        ),
                    ]
                )

        await asyncio.gather(*(partition(k) for k in range(PARTITIONS)))
        return EVENTS / (time.monotonic() - started)
    finally:
        await mongo.drop_database(name)


def _now() -> datetime:
    return datetime.now(timezone.utc)


async def _spread(leases: Any, share: list[int]) -> bool:
    """Whether the live partition leases are held as ``share`` says (partitions per member)."""
    held: dict[str, int] = {}
    now = time.time()
    async for doc in leases.find({"owner": {"$ne": None}}):
        if doc["lease_until"].timestamp() > now:
            held[doc["owner"]] = held.get(doc["owner"], 0) + 1
    return sorted(held.values()) == share


async def poll(condition: Callable[[], Awaitable[bool]], every: float = 0.05) -> None:
    while True:
        if await condition():
            return
        await asyncio.sleep(every)


def describe(stats: list[dict[str, Any]], seconds: float) -> str:
    """One line per run: each member's events per partition, window use, claims, leases,
    MongoDB commands and time."""
    parts = []
    for s in stats:
        counts = Counter(s["counts"])
        span = max((s["last"] or 0) - (s["first"] or 0), 1e-9)
        db = sum(s["db_seconds"].values())
        claims = counts["due_queries"]
        parts.append(
            f"[{'/'.join(f'p{k}:{n}' for k, n in s['partitions'].items())}"
            f" sent {(s['first'] or 0) - s['released']:+.2f}s..{s['last'] - s['released']:+.2f}s"
            f" window {s['busy'] / (WINDOW * span):.0%}"
            f" claims {claims} ({claims - counts['claims']} empty,"
            f" {counts['collided']} collided)"
            f" leases +{counts['leases_taken']}/-{counts['leases_lost']}"
            f" dup {s['duplicates']}"
            f" db {sum(s['commands'].values())} cmds {db:.2f}s]"
        )
    return f"    {seconds:.2f}s " + " ".join(parts)


def busiest(stats: list[dict[str, Any]]) -> str:
    """The member's MongoDB commands that took the most time in total."""
    total: dict[str, float] = {}
    count: Counter[str] = Counter()
    for s in stats:
        for name, seconds in s["db_seconds"].items():
            total[name] = total.get(name, 0.0) + seconds
        count.update(s["commands"])
    slowest = sorted(total.items(), key=lambda item: -item[1])[:4]
    return ", ".join(
        f"{name} {count[name]}x {seconds / count[name] * 1000:.0f}ms" for name, seconds in slowest
    )


async def rebalance(uri: str) -> float:
    """Seconds from SIGKILLing one of two members until the other holds every partition."""
    mongo = client(uri)
    name = unique("group")
    ignored: asyncio.Queue[tuple[float, str]] = asyncio.Queue()
    members = [await spawn(uri, ignored) for _ in range(2)]
    try:
        outbox = Outbox(mongo[name], partitions=PARTITIONS)
        await outbox.ensure_indexes()
        for m in members:
            await m.send(f"start {name} {TAKEOVER_LEASE}")
        leases = mongo[name].outbox_relays
        await poll(lambda: _spread(leases, [2, 2]))
        await members[0].kill()
        killed = time.perf_counter()
        await poll(lambda: _spread(leases, [PARTITIONS]))
        return time.perf_counter() - killed
    finally:
        for m in members:
            await m.kill()
        await mongo.drop_database(name)
        await mongo.close()


async def run(uri: str) -> list[str]:
    header(
        f"RelayGroup: {EVENTS} events, {PARTITIONS} partitions, a sink per member of "
        f"{WINDOW} in flight x {LATENCY * 1000:g} ms (at most {WINDOW / LATENCY:.0f} events/s "
        f"a member), {ROUNDS} interleaved rounds, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}"
    )
    started = time.perf_counter()
    confirms: asyncio.Queue[tuple[float, str]] = asyncio.Queue()
    pool = [await spawn(uri, confirms) for _ in range(POOL)]
    mongo = client(uri)
    rates: dict[int, list[float]] = {1: [], 2: [], 4: []}
    ratios: dict[int, list[float]] = {2: [], 4: []}
    hand: list[float] = []
    all_stats: list[dict[str, Any]] = []
    try:
        # 0: the store's commands by hand (no members), in the rotation like the others.
        orders = [(1, 2, 4, 0), (2, 4, 0, 1), (4, 0, 1, 2)]
        for r in range(ROUNDS):
            this: dict[int, float] = {}
            for k in orders[r % len(orders)]:
                if k == 0:
                    hand.append(await by_hand(mongo))
                    say(f"  round {r + 1}, the store by hand: {hand[-1]:5.0f} events/s")
                    continue
                rate, stats = await throughput(mongo, pool, confirms, k)
                this[k] = rate
                rates[k].append(rate)
                all_stats += stats
                say(f"  round {r + 1}, {k} member(s): {rate:5.0f} events/s")
                say(describe(stats, EVENTS / rate))
            for k in (2, 4):
                ratios[k].append(this[k] / this[1])
            say(f"  round {r + 1}: 2 = {this[2] / this[1]:.2f}x, 4 = {this[4] / this[1]:.2f}x")
    finally:
        for m in pool:
            await m.kill()
        await mongo.close()
    say(f"MongoDB time by command (all runs): {busiest(all_stats)}")
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k in (1, 2, 4):
        each = "" if k == 1 else f"; rounds {', '.join(f'{x:.2f}x' for x in ratios[k])}"
        say(
            f"{k} member(s): median {med[k]:5.0f} events/s "
            f"({statistics.median(ratios[k]) if k > 1 else 1.0:.2f}x of 1, median of rounds{each})"
        )
    say(
        f"the store by hand (no library, no sink): median {statistics.median(hand):5.0f} "
        f"events/s (rounds {', '.join(f'{x:.0f}' for x in hand)}); 4 members need "
        f"{4 * WINDOW / LATENCY:.0f}"
    )
    say(f"throughput runs took {time.perf_counter() - started:.0f} s")
    takeover = await rebalance(uri)
    say(f"takeover after SIGKILL of 1 of 2 members: {takeover:.1f} s (lease {TAKEOVER_LEASE:g} s)")
    return [
        f"1 member {med[1]:.0f}/s; 2: {statistics.median(ratios[2]):.2f}x "
        f"(rounds {', '.join(f'{x:.2f}' for x in ratios[2])}); "
        f"4: {statistics.median(ratios[4]):.2f}x "
        f"(rounds {', '.join(f'{x:.2f}' for x in ratios[4])})",
        f"the store by hand (no library, no sink) {statistics.median(hand):.0f}/s; 4 members "
        f"need {4 * WINDOW / LATENCY:.0f}/s",
        f"takeover after SIGKILL {takeover:.1f} s (lease {TAKEOVER_LEASE:g} s)",
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["member"]:
        # A member's lost leases and takeovers, on stderr, as the command line logs them.
        logging.basicConfig(level=logging.WARNING, format="member %(process)d: %(message)s")
        logging.getLogger().handlers[0].setLevel(logging.WARNING)
        logging.getLogger("mongo_outbox").setLevel(logging.INFO)  # counted by LeaseLog
        asyncio.run(member(sys.argv[2]))
    else:
        standalone(run)
