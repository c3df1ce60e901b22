"""A requeue of a large parked set: any number of events, in commands of bounded size, with
each aggregate's order kept, from the library and from ``mongo-outbox parked requeue`` (which
says how far it got). A requeue used to be one command naming every id and aggregate: at about
130k parked events it outgrew MongoDB's 16 MiB and requeued nothing."""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Any

import bson
import pytest
from pymongo import AsyncMongoClient, monitoring

from mongo_outbox import Event, InvalidEventError, Outbox, PollingRelay
from mongo_outbox._relay.store import base as store_base
from mongo_outbox._relay.store import store_for
from mongo_outbox._relay.store.base import ParkedKey
from mongo_outbox.cli.console import data as console_data
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher
from tests.support.cli import cli, environment
from tests.support.outboxes import MODES, make_outbox, unsettled
from tests.support.servers import MongoServer

AGGREGATES = 24
SAVES = 4
EVENTS = 25  # per save: 2,400 in all, more than two batches of REQUEUE_BATCH


class Commands(monitoring.CommandListener):
    """Every command the client sends and every reply, encoded, to measure what a requeue
    sends and reads."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.read = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.sent.append(bson.encode(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        self.read += len(bson.encode(event.reply))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


async def park_many(
    outbox: Outbox, db: Any, saves: int = SAVES, events: int = EVENTS, padding: int = 0
) -> list[Event]:
    """``saves`` saves of ``events`` events in each of 24 aggregates, every one parked; each
    payload holds ``padding`` more bytes."""
    saved: list[Event] = []
    for step in range(saves):
        for aggregate in range(AGGREGATES):
            batch = [
                Event(type=f"noted{n % 2}", payload={"n": n, "pad": "x" * padding})
                for n in range(events)
            ]
            result = await outbox.save_with_events(
                None, db.orders, {"_id": aggregate, "step": step}, batch
            )
            saved += result.events
    # Parked as settle parks them, in one write: a relay refusing 2,400 events one by one
    # takes minutes on the emulator.
    why = "ValueError: a template that fits no event"
    if outbox.mode == "collection":
        await db.outbox.update_many(
            {}, {"$set": {"status": "parked", "attempts": 1, "last_error": why}}
        )
    else:
        entries = f"{outbox.field}.$[]"
        await db.orders.update_many(
            {},
            {
                "$set": {f"{entries}.parked": True, f"{entries}.last_error": why},
                "$unset": {outbox.due_field: ""},
            },
        )
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 0
    return saved


async def drained_in_order(outbox: Outbox, saved: list[Event]) -> None:
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == len(saved)
    sequences: dict[Any, list[int]] = defaultdict(list)
    for event in publisher.events:
        sequences[event.aggregate_id].append(event.sequence or 0)
    assert sorted(e.id for e in publisher.events) == sorted(e.id for e in saved)
    for aggregate, found in sequences.items():
        assert found == sorted(found), f"aggregate {aggregate} out of order"


@pytest.mark.parametrize("mode", MODES)
async def test_a_large_parked_set_is_requeued_in_bounded_commands_in_order(
    db: Any, mongo: MongoServer, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight batches of 40: the emulator's writes cost O(collection), so thousands of events
    take minutes here; the CLI test below runs at the real batch size."""
    monkeypatch.setattr(store_base, "REQUEUE_CHUNK", 40)
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    saved = await park_many(outbox, db, saves=2, events=6)  # 288
    ids = [e.id for e in saved]
    listener = Commands()
    watched: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, tz_aware=True, event_listeners=[listener]
    )
    try:
        relay = PollingRelay(make_outbox(watched[db.name], mode), MemoryPublisher())
        assert len(await relay.parked()) == len(saved)
        listener.sent.clear()
        assert await relay.requeue(ids) == len(saved)
    finally:
        await watched.close()
    named = [sum(i.encode() in command for i in ids) for command in listener.sent]
    assert max(named) <= 40, "a command names more ids than a batch"
    assert sum(1 for n in named if n) >= len(saved) // 40  # batch after batch
    await drained_in_order(outbox, saved)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["embedded"])  # the cheaper mode: the CLI's part is the same
async def test_the_cli_requeues_a_large_parked_set_showing_its_progress(
    db: Any, mongo: MongoServer, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    saved = await park_many(outbox, db)
    where = [f"--uri={mongo.uri}", f"--db={db.name}", f"--mode={mode}", "--collections=orders"]
    # Not a terminal: plain progress lines (here every 10 ms), the last one at the end.
    ran = await cli(
        "parked",
        "requeue",
        *where,
        "--all",
        env=environment(MONGO_OUTBOX_PROGRESS_EVERY="0.01"),
    )
    assert ran.code == 0, ran.output
    assert ran.out.strip() == f"requeued {len(saved)} parked events"
    lines = ran.err.splitlines()
    assert lines[-1].startswith(f"requeue: {len(saved):,}/{len(saved):,} events (100%)"), lines
    # Every one is pending again (the test above publishes them, in order).
    left = await unsettled(outbox, db)
    assert len(left) == len(saved)
    assert all(e.get("status", "pending") == "pending" and not e.get("parked") for e in left)


@pytest.mark.parametrize("mode", MODES)
async def test_choosing_what_to_requeue_reads_ids_types_and_aggregates_not_payloads(
    db: Any, mongo: MongoServer, mode: str
) -> None:
    """``parked requeue --all`` (or ``--type``, ``--aggregate``, the console's "requeue all")
    chooses from every parked entry: it reads each one's id, type and aggregate, not the whole
    entry, so a large parked set is not held in memory (it used to read every entry whole)."""
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    padding = 20_000
    saved = await park_many(outbox, db, saves=1, events=2, padding=padding)  # 48, ~1 MB
    listener = Commands()
    watched: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, tz_aware=True, event_listeners=[listener]
    )
    try:
        store = store_for(make_outbox(watched[db.name], mode))
        keys = await store.parked_keys()
        read = listener.read
        some = await store.parked([saved[0].id, saved[3].id, "no-such-event"])
    finally:
        await watched.close()
    assert sorted(keys) == sorted((e.id, e.type, e.aggregate_id) for e in saved)
    assert read < len(saved) * padding / 10, f"{read:,} bytes read to choose"
    # Asked for by id, the entries come whole, and only those parked.
    assert [e["_id"] for e in some] == sorted([saved[0].id, saved[3].id])
    assert all(len(e["payload"]["pad"]) == padding for e in some)
    assert [key.id for key in keys if key.matches(["noted1"], [])] == sorted(
        e.id for e in saved if e.type == "noted1"
    )


async def test_entries_of_odd_ids_are_chosen_listed_and_requeued_without_a_crash(db: Any) -> None:
    # Entries of another producer, parked as unreadable: an id that is a document, a number,
    # none at all. Choosing by type (the console's page, parked list --type) lists each once,
    # by its own key, and a requeue of them all takes those it can name.
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    due = {"_sequence": 1, "_outbox_due": utc_now()}
    await db.orders.insert_many(
        [
            {"_id": 1, **due, "_outbox": [{"id": {"a": 1}, "type": "odd", "sequence": 1}]},
            {"_id": 2, **due, "_outbox": [{"id": 7, "type": "odd", "sequence": 1}]},
            {"_id": 3, **due, "_outbox": [{"type": "none", "sequence": 1}]},
            {"_id": 4, **due, "_outbox": ["not a document"]},
        ]
    )
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 0
    store = store_for(outbox)
    keys = await store.parked_keys()
    assert sorted(map(repr, keys)) == sorted(
        map(repr, [ParkedKey.of(e) for e in await store.parked()])
    )
    assert len(keys) == 4
    conn = types.SimpleNamespace(outbox=outbox)
    odd = await console_data.parked(conn, ["odd"], [])  # type: ignore[arg-type]
    assert sorted(map(repr, (e.event_id for e in odd.entries))) == ["7", "{'a': 1}"]
    none = await console_data.parked(conn, ["none"], [])  # type: ignore[arg-type]
    assert [(e.event_id, e.type) for e in none.entries] == [(None, "none")]
    assert [e["_id"] for e in await store.parked([{"a": 1}])] == [{"a": 1}]
    # The two with an id come back; the two without one cannot be named (fixed by hand).
    assert await store.requeue([key.id for key in keys]) == 2


async def test_a_requeue_of_aggregates_with_long_ids_sends_each_command_under_16_mib(
    db: Any, mongo: MongoServer
) -> None:
    # A batch was bounded by its count of ids alone, and each asked-for entry's aggregate goes
    # into the command that brings its earlier parked entries back: 1,000 aggregates of 16 KB
    # ids made one command over 16 MiB (PyMongo's DocumentTooLarge), and nothing was requeued.
    # Here fewer aggregates, with longer ids: the same 19 MB.
    outbox = make_outbox(db, "collection")
    await outbox.ensure_indexes()
    long_ids = [f"{n:03}" + "x" * 160_000 for n in range(120)]
    saved: list[Event] = []
    for aggregate in long_ids:
        result = await outbox.save_with_events(
            None, db.orders, {"_id": aggregate}, [Event(type="noted")]
        )
        saved += result.events
    relay = PollingRelay(outbox, MemoryPublisher(fail=lambda e: InvalidEventError("no")))
    assert await relay.drain() == 0
    assert len(await relay.parked()) == len(saved)
    listener = Commands()
    watched: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, tz_aware=True, event_listeners=[listener]
    )
    try:
        watching = PollingRelay(make_outbox(watched[db.name]), MemoryPublisher())
        assert await watching.requeue([e.id for e in saved]) == len(saved)
    finally:
        await watched.close()
    assert max(len(command) for command in listener.sent) < 16 * 1024 * 1024
    await drained_in_order(outbox, saved)
