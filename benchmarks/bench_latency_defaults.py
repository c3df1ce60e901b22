"""Commit-to-broker latency at the defaults: ``mongo-outbox relay`` with no tuning (the
change-stream relay, collection mode) in a process of its own, single-event saves at a steady
pace, measured from each save's return to the time JetStream stored the message (its
metadata timestamp; the receive time of a subscriber here is printed beside it).

The relay runs under a thin wrapper (this module's ``relay`` mode) that notes, with wall-clock
times, each MongoDB command its client sends (a global PyMongo CommandListener) and each
publish to NATS. So each event's latency splits into: MongoDB commands (the server's work and
the loopback round trip: the getMore that brings the change, the claim, a checkpoint save under
way), the broker (from the publish to the stored timestamp) and the relay process (the rest:
Python between the commands). A baseline from the same run, also in a process of its own
(``baseline`` mode), is the floor the server allows: a raw PyMongo ``watch()`` whose loop
publishes each insert with nats-py, no claim and no settle.

On the emulator it ends with the emulator's own CPU for one lone change's claim (the relay's
two commands before its publish) beside a ``ping``'s, read from the emulator process's CPU time:
the part of the window that a replica set, answering from indexes, would not have.

    python -m benchmarks.bench_latency_defaults     # MONGODB_URI, else the emulator
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pymongo import AsyncMongoClient
from pymongo.monitoring import (
    CommandFailedEvent,
    CommandListener,
    CommandStartedEvent,
    CommandSucceededEvent,
)

from benchmarks.common import NATS_URL, header, say, standalone, unique
from mongo_outbox import Event, Outbox

EVENTS = 200
SPACING = 0.05  # seconds between commits: far more than one event's work, so none queue
RELAY = "outbox-relay"  # the command line's default name
Span = tuple[str, int, int]  # (what, start ns, end ns), wall clock


class Timeline(CommandListener):
    """Every command a process's clients send, with wall-clock start and end."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._started: dict[tuple[int, Any], tuple[str, int]] = {}

    def started(self, event: CommandStartedEvent) -> None:
        self._started[(event.request_id, event.connection_id)] = (
            event.command_name,
            time.time_ns(),
        )

    def succeeded(self, event: CommandSucceededEvent) -> None:
        self._end(event.request_id, event.connection_id)

    def failed(self, event: CommandFailedEvent) -> None:
        self._end(event.request_id, event.connection_id)

    def _end(self, request_id: int, connection_id: Any) -> None:
        begun = self._started.pop((request_id, connection_id), None)
        if begun is not None:
            self.spans.append((begun[0], begun[1], time.time_ns()))

    def dump(self, path: str) -> None:
        Path(path).write_text(json.dumps(self.spans))


def timed_relay(path: str, argv: list[str]) -> None:
    """``mongo-outbox`` with ``argv``, its commands and publishes noted in ``path`` at exit."""
    import pymongo.monitoring

    from mongo_outbox.cli import main
    from mongo_outbox.publishers import NatsPublisher

    timeline = Timeline()
    pymongo.monitoring.register(timeline)
    publish_many = NatsPublisher.publish_many

    async def noted(self: NatsPublisher, events: Sequence[Event]) -> list[BaseException | None]:
        start = time.time_ns()
        try:
            return await publish_many(self, events)
        finally:
            timeline.spans.append(("publish", start, time.time_ns()))

    NatsPublisher.publish_many = noted  # type: ignore[method-assign]
    try:
        main(argv)
    finally:
        timeline.dump(path)


async def baseline(uri: str, db: str, subject: str, path: str) -> None:
    """The floor: a raw change stream on the outbox collection, each insert published with
    nats-py as it comes, until SIGTERM."""
    import nats

    timeline = Timeline()
    mongo: AsyncMongoClient[Any] = AsyncMongoClient(uri, event_listeners=[timeline])
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    stream = await mongo[db].outbox.watch([{"$match": {"operationType": "insert"}}])
    print("ready", flush=True)
    try:
        while not stop.is_set():
            change = await stream.try_next()
            if change is None:
                continue
            doc = change["fullDocument"]
            start = time.time_ns()
            await js.publish(subject, b"{}", headers={"Nats-Msg-Id": str(doc["_id"])})
            timeline.spans.append(("publish", start, time.time_ns()))
    finally:
        await stream.close()
        await nc.close()
        await mongo.close()
        timeline.dump(path)


async def wait_for_lease(db: Any, process: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"the relay exited with status {process.returncode}")
        doc = await db.outbox_relays.find_one({"_id": RELAY})
        if doc and doc["lease_until"] > datetime.now(UTC):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the relay did not become active within 30 s")


class Arrivals:
    """What the broker stored (its timestamp) and when a subscriber here received it, by id."""

    def __init__(self) -> None:
        self.stored: dict[str, int] = {}
        self.received: dict[str, int] = {}
        self.changed = asyncio.Event()

    async def on_message(self, message: Any) -> None:
        now = time.time_ns()
        key = message.headers.get("Nats-Msg-Id") if message.headers else None
        if key is None:
            return
        self.received.setdefault(key, now)
        self.stored.setdefault(key, int(message.metadata.timestamp.timestamp() * 1e9))
        self.changed.set()


async def measure(uri: str, kind: str) -> tuple[dict[str, tuple[int, int, int]], list[Span]]:
    """Commit EVENTS single-event saves SPACING apart with ``kind`` ("relay" or "baseline")
    following; returns, per event id, (save returned, stored, received) in wall-clock ns, and
    the follower's timeline."""
    import nats

    name = unique("benchlat")
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    arrivals = Arrivals()
    await js.subscribe(f"{name}.>", cb=arrivals.on_message, ordered_consumer=True)
    mongo: AsyncMongoClient[Any] = AsyncMongoClient(uri, tz_aware=True)
    db = mongo[name]
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await db.create_collection("orders")
    path = tempfile.mktemp(prefix=f"{name}-", suffix=".json")
    me = [sys.executable, "-m", "benchmarks.bench_latency_defaults", kind, path]
    if kind == "relay":
        args = ["relay", "--uri", uri, "--db", name, "--nats", NATS_URL, "--subject"]
        process = await asyncio.create_subprocess_exec(*me, *args, f"{name}.{{type}}")
        await wait_for_lease(db, process)
    else:
        process = await asyncio.create_subprocess_exec(
            *me, uri, name, f"{name}.raw", stdout=asyncio.subprocess.PIPE
        )
        assert process.stdout is not None
        await process.stdout.readline()
    await asyncio.sleep(0.5)  # past the relay's opening sweep and first checkpoint
    saved: dict[str, int] = {}
    try:
        for n in range(EVENTS):
            event = Event(type="t")
            await outbox.save_with_events(None, db.orders, {"_id": n}, [event])
            saved[event.id] = time.time_ns()
            await asyncio.sleep(SPACING)
        deadline = time.monotonic() + 30
        while len(arrivals.stored) < EVENTS and time.monotonic() < deadline:
            arrivals.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrivals.changed.wait(), 1)
    finally:
        process.send_signal(signal.SIGTERM)
        await process.wait()
        await js.delete_stream(name)
        await nc.close()
        await mongo.drop_database(name)
        await mongo.close()
    return times_of(saved, arrivals), read_spans(path)


def read_spans(path: str) -> list[Span]:
    spans = [(str(w), int(s), int(e)) for w, s, e in json.loads(Path(path).read_text())]
    os.unlink(path)
    return spans


def times_of(saved: dict[str, int], arrivals: Arrivals) -> dict[str, tuple[int, int, int]]:
    return {
        i: (t, arrivals.stored[i], arrivals.received[i])
        for i, t in saved.items()
        if i in arrivals.stored
    }


def overlap(spans: list[Span], start: int, end: int, names: set[str] | None = None) -> int:
    return sum(
        max(0, min(e, end) - max(s, start))
        for what, s, e in spans
        if names is None or what in names
    )


def breakdown(times: dict[str, tuple[int, int, int]], spans: list[Span]) -> dict[str, list[float]]:
    """Per event, milliseconds of its commit-to-stored window spent in each part."""
    commands = {what for what, _, _ in spans if what != "publish"}
    parts: dict[str, list[float]] = {"latency": [], "received": [], "broker": [], "mongodb": []}
    per_command: dict[str, list[float]] = {c: [] for c in sorted(commands)}
    for start, stored, received in times.values():
        parts["latency"].append((stored - start) / 1e6)
        parts["received"].append((received - start) / 1e6)
        parts["broker"].append(overlap(spans, start, stored, {"publish"}) / 1e6)
        parts["mongodb"].append(overlap(spans, start, stored, commands) / 1e6)
        for command in commands:
            per_command[command].append(overlap(spans, start, stored, {command}) / 1e6)
    parts["process"] = [
        total - broker - mongodb
        for total, broker, mongodb in zip(
            parts["latency"], parts["broker"], parts["mongodb"], strict=True
        )
    ]
    return parts | {f"  {c}": v for c, v in per_command.items() if max(v, default=0) > 0}


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


async def run(uri: str) -> list[str]:
    header(
        f"Commit-to-broker latency, `mongo-outbox relay` at its defaults, {EVENTS} single-event "
        f"saves {SPACING * 1000:.0f} ms apart, to NATS JetStream"
    )
    lines = []
    for kind, label in (("relay", "mongo-outbox relay"), ("baseline", "raw watch + publish")):
        times, spans = await measure(uri, kind)
        parts = breakdown(times, spans)
        latency = parts["latency"]
        lines.append(
            f"{label:<20} p50 {pct(latency, 50):6.1f} ms  p95 {pct(latency, 95):6.1f} ms  "
            f"max {max(latency):6.1f} ms  ({len(latency)}/{EVENTS} stored; received by a "
            f"subscriber p50 {pct(parts['received'], 50):.1f} ms)"
        )
        say(lines[-1])
        for part, values in parts.items():
            if part in ("latency", "received"):
                continue
            say(
                f"    {part:<18} p50 {pct(values, 50):6.2f} ms  mean {statistics.mean(values):6.2f}"
                f" ms  p95 {pct(values, 95):6.2f} ms"
            )
    if not os.environ.get("MONGODB_URI"):
        lines += await emulator_share()
    return lines


CLAIMS = 400


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user and system), from /proc: whatever the machine's load,
    what that process itself spent."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stored(prefix: str, count: int, status: str) -> list[dict[str, Any]]:
    """``count`` entries as the outbox stores them, each the first of an aggregate of its own."""
    from mongo_outbox._codec import encode
    from mongo_outbox.events import utc_now

    return [
        encode(Event(type="t", aggregate_type="o", aggregate_id=f"{prefix}{n}", sequence=1), "_id")
        | {"status": status, "available_at": utc_now(), "attempts": 0}
        for n in range(count)
    ]


async def emulator_share() -> list[str]:
    """The emulator's own CPU for one lone change's claim (the ``updateMany`` by id and the
    order ``find``, as the relay sends them), against its CPU for a ``ping``: read from the
    emulator process's CPU time, so the figure holds on a loaded machine, and is the part of the
    latency above that a replica set answering from its indexes would not have."""
    from mongo_outbox._relay.store.collection import CollectionStore
    from mongo_outbox.testing import start_emulator

    lines = []
    with start_emulator() as emulator:
        mongo: Any = AsyncMongoClient(emulator.uri, tz_aware=True)
        try:
            for entries in (300, 3000):
                db = mongo[unique("benchemu")]
                outbox = Outbox(db)
                await outbox.ensure_indexes()
                await outbox.collection.insert_many(stored("a", entries, "published"))
                fresh = stored("b", CLAIMS, "pending")
                await outbox.collection.insert_many(fresh)
                store = CollectionStore(outbox)
                pid = emulator.process.pid
                before = cpu_seconds(pid)
                for _ in range(CLAIMS):
                    await db.command("ping")
                ping = (cpu_seconds(pid) - before) / CLAIMS
                before = cpu_seconds(pid)
                for entry in fresh:
                    change = {"operationType": "insert", "fullDocument": entry}
                    claim = await store.claim_changes([change], timedelta(seconds=30))
                    assert claim.events == 1
                claim_cpu = (cpu_seconds(pid) - before) / CLAIMS
                lines.append(
                    f"emulator CPU, one lone change's claim at {entries:>5} entries: "
                    f"{claim_cpu * 1e3:5.2f} ms for its 2 commands; a ping {ping * 1e3:4.2f} ms"
                    f" (ratio {claim_cpu / ping:4.1f})"
                )
                say(lines[-1])
                await mongo.drop_database(db.name)
        finally:
            await mongo.close()
    return lines


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "relay":
        timed_relay(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) > 2 and sys.argv[1] == "baseline":
        uri, db, subject = sys.argv[3:6]
        asyncio.run(baseline(uri, db, subject, sys.argv[2]))
    else:
        standalone(run)
