"""TenantRelays: one process relays several databases' outboxes to the real NATS, and one
database's backlog does not starve another's."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import pytest
from pymongo.errors import OperationFailure

from mongo_outbox import (
    ChangeStreamError,
    ChangeStreamRelay,
    Event,
    Outbox,
    PollingRelay,
    RelaySettings,
    UsageError,
)
from mongo_outbox.publishers import MemoryPublisher, NatsPublisher
from mongo_outbox.tenants import TenantRelays
from tests.support.changestream_sources import ScriptedSource
from tests.support.cli import Service, cli, held, lease_of, until_active
from tests.support.servers import NATS_URL, RABBITMQ_URL, MongoServer
from tests.support.waiting import until


@pytest.fixture
async def databases(client: Any) -> AsyncIterator[list[Any]]:
    """Three databases of this test's own, dropped afterwards."""
    names = [f"t_{uuid.uuid4().hex[:12]}" for _ in range(3)]
    yield [client[name] for name in names]
    for name in names:
        await client.drop_database(name)


def relay(outbox: Outbox, publisher: Any, **settings: Any) -> ChangeStreamRelay:
    return ChangeStreamRelay(
        outbox,
        publisher,
        name="tenant-relay",
        settings=RelaySettings(**settings),
        leader_lease=30.0,
        sweep_interval=60.0,
    )


async def consumed(nats_client: Any, stream: str, count: int) -> list[dict[str, Any]]:
    """The first ``count`` messages of ``stream``: subject, event id and database."""
    js = nats_client.jetstream()
    sub = await js.pull_subscribe(f"{stream}.>", durable=None, stream=stream)
    seen: list[dict[str, Any]] = []
    while len(seen) < count:
        for msg in await sub.fetch(count - len(seen), timeout=10):
            body = json.loads(msg.data)
            seen.append({"subject": msg.subject, "id": msg.headers["Nats-Msg-Id"], "body": body})
            await msg.ack()
    await sub.unsubscribe()
    return seen


async def test_one_process_relays_every_database_in_either_mode(
    databases: list[Any], nats_client: Any, nats_stream: str
) -> None:
    first, second, third = databases
    outboxes = [
        Outbox(first),
        Outbox(second),
        Outbox(third, mode="embedded", collections=["carts"]),
    ]
    for outbox in outboxes:
        await outbox.ensure_indexes()
    saved: dict[str, str] = {}
    for db, outbox, collection in zip(
        databases, outboxes, ["orders", "orders", "carts"], strict=True
    ):
        result = await outbox.save_with_events(
            None, db[collection], {"_id": 1}, [Event(type="opened", payload={"db": db.name})]
        )
        saved[result.events[0].id] = db.name
    publisher = await NatsPublisher.connect(NATS_URL, subject=nats_stream + ".{type}")
    tenants = TenantRelays([relay(outbox, publisher) for outbox in outboxes])
    task = asyncio.ensure_future(tenants.run())
    try:
        await until(lambda: all(r.state == "active" for r in tenants.relays.values()))
        # While they run, the embedded tenant saves more (a single-document write; see
        # docs/testing.md for why the emulator tests save in collection mode before the start).
        later = await outboxes[2].save_with_events(
            None, third.carts, {"_id": 2}, [Event(type="opened", payload={"db": third.name})]
        )
        saved[later.events[0].id] = third.name
        messages = await consumed(nats_client, nats_stream, 4)
        assert {m["id"]: m["body"]["payload"]["db"] for m in messages} == saved

        statuses = await tenants.status()
        assert set(statuses) == {db.name for db in databases}

        async def settled() -> bool:
            # The broker confirms before the relay marks the event published: wait for both.
            statuses = (await tenants.status()).values()
            return all(s.state == "active" and s.pending == 0 for s in statuses)

        await until(settled, timeout=20)
    finally:
        tenants.stop()
        await asyncio.wait_for(task, 20)
        await publisher.aclose()
    assert {s.state for s in (await tenants.status()).values()} == {"stopped"}
    # Each gave its lease up, in its own database: it has run out already.
    for db in databases:
        checkpoint = await db.outbox_relays.find_one({"_id": "tenant-relay"})
        assert checkpoint is not None
        assert checkpoint["lease_until"] <= datetime.now(timezone.utc)


@pytest.mark.slow
async def test_a_backlog_does_not_starve_another_database(databases: list[Any]) -> None:
    busy, quiet, _ = databases
    busy_outbox = Outbox(busy)
    quiet_outbox = Outbox(quiet, mode="embedded", collections=["carts"])
    await busy_outbox.ensure_indexes()
    await quiet_outbox.ensure_indexes()
    for order in range(40):
        events = [Event(type="line.added", payload={"n": n}) for n in range(25)]
        await busy_outbox.save_with_events(None, busy.orders, {"_id": order}, events)
    backlog = 40 * 25
    # One publisher for both: it keeps one list, in publication order.
    publisher = MemoryPublisher()
    tenants = TenantRelays(
        [relay(busy_outbox, publisher, batch_size=10), relay(quiet_outbox, publisher)]
    )
    task = asyncio.ensure_future(tenants.run())
    try:
        await publisher.wait_for(1, timeout=30)  # the busy database's backlog is being drained
        saved = await quiet_outbox.save_with_events(
            None, quiet.carts, {"_id": 1}, [Event(type="opened")]
        )
        quiet_id = saved.events[0].id
        await until(lambda: quiet_id in {e.id for e in publisher.events}, timeout=30)
        ahead = [e.id for e in publisher.events].index(quiet_id)
        # Had the busy relay's backlog gone first, all of it would be ahead of the quiet event.
        assert ahead < backlog / 2, f"{ahead} of the backlog's {backlog} events went first"
        await publisher.wait_for(backlog + 1, timeout=60)
    finally:
        tenants.stop()
        await asyncio.wait_for(task, 20)
    assert len({e.id for e in publisher.events}) == backlog + 1


async def test_one_relay_failing_stops_the_others_and_run_raises(databases: list[Any]) -> None:
    healthy, broken, _ = databases
    source = ScriptedSource()
    # What a server without change streams answers: no retry can fix it.
    source.open_errors.append(OperationFailure("not a replica set", code=40573))
    publisher = MemoryPublisher()
    healthy_relay = relay(Outbox(healthy), publisher)
    broken_relay = ChangeStreamRelay(
        Outbox(broken), publisher, name="tenant-relay", source=source, leader_lease=30.0
    )
    tenants = TenantRelays([healthy_relay, broken_relay])
    with pytest.raises(ChangeStreamError, match="not a replica set"):
        await asyncio.wait_for(tenants.run(), 30)
    assert healthy_relay.state == "stopped"
    assert broken_relay.state == "failed"


async def test_misuse_is_refused(databases: list[Any]) -> None:
    publisher = MemoryPublisher()
    first = Outbox(databases[0])
    with pytest.raises(UsageError, match="two relays for database"):
        TenantRelays([relay(first, publisher), PollingRelay(first, publisher)])
    with pytest.raises(UsageError, match="at least one relay"):
        TenantRelays([])
    with pytest.raises(UsageError, match="not Outbox"):
        TenantRelays([first])  # type: ignore[list-item]


async def test_the_command_line_relays_several_databases_and_stops_cleanly(
    mongo: MongoServer, databases: list[Any], nats_client: Any, nats_stream: str
) -> None:
    outboxes = [Outbox(db, mode="embedded", collections=["orders"]) for db in databases]
    for outbox in outboxes:
        await outbox.ensure_indexes()
    relay = await Service(
        "relay",
        f"--uri={mongo.uri}",
        "--databases=" + ",".join(db.name for db in databases),
        "--mode=embedded",
        "--collections=orders",
        f"--nats={NATS_URL}",
        f"--subject={nats_stream}.{{type}}",
    ).start()
    try:
        for db in databases:
            await until_active(db, "outbox-relay", relay)
        saved = {}
        for db, outbox in zip(databases, outboxes, strict=True):
            result = await outbox.save_with_events(
                None, db.orders, {"_id": 1}, [Event(type="placed", payload={"db": db.name})]
            )
            saved[result.events[0].id] = db.name
        messages = await consumed(nats_client, nats_stream, len(saved))
        ran = await relay.stop(signal.SIGTERM, timeout=15)
    finally:
        relay.kill()
    assert {m["id"]: m["body"]["payload"]["db"] for m in messages} == saved
    assert ran.code == 0, ran.output
    for db in databases:
        assert not held(await lease_of(db, "outbox-relay"))  # each gave its lease up
        # Every database's relay is named outbox-relay: its lines say which database.
        assert f": [{db.name}] relay outbox-relay: active -> stopped" in ran.err, ran.err


async def test_a_drain_of_several_databases_says_which_each_line_is_about(
    mongo: MongoServer, databases: list[Any], channel: Any, unique: str
) -> None:
    for db in databases:
        outbox = Outbox(db)
        await outbox.ensure_indexes()
        await outbox.save_with_events(
            None, db.orders, {"_id": 1}, [Event(type="placed", payload={"note": "x" * 2000})]
        )
    ran = await cli(
        "relay",
        "--drain",
        f"--uri={mongo.uri}",
        "--databases=" + ",".join(db.name for db in databases),
        f"--rabbitmq={RABBITMQ_URL}",
        f"--exchange={unique}",
        "--declare-exchange",
        "--max-message-size=1000",  # every event is parked: one error line per database
    )
    assert ran.code == 1, ran.output
    parking = [line for line in ran.err.splitlines() if " parking " in line]
    assert len(parking) == len(databases), ran.err
    for db, line in zip(databases, parking, strict=True):
        assert f": [{db.name}] parking " in line


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--db=shop", "--databases=a,b"], "exclude each other"),
        (["--databases=a,a"], "names a database twice"),
        (["--databases= , "], "names no database"),
    ],
)
async def test_the_command_line_refuses_bad_database_lists(
    mongo: MongoServer, flags: list[str], reason: str
) -> None:
    ran = await cli("relay", f"--uri={mongo.uri}", f"--nats={NATS_URL}", *flags)
    assert ran.code != 0
    assert reason in ran.err and len(ran.err.strip().splitlines()) == 1, ran.err


@pytest.mark.parametrize(
    ("states", "whole"),
    [
        (["active", "standby"], "active"),
        (["standby", "standby"], "standby"),
        (["starting", "active"], "starting"),
        (["active", "failed"], "failed"),
        (["stopped", "active"], "active"),
        (["stopped", "stopped"], "stopped"),
    ],
)
def test_the_state_of_the_whole_is_what_healthz_needs(
    databases: list[Any], states: list[str], whole: str
) -> None:
    relays = [PollingRelay(Outbox(db), MemoryPublisher()) for db in databases[:2]]
    for relay, state in zip(relays, states, strict=True):
        relay.state = state  # type: ignore[assignment]
    assert TenantRelays(relays).state == whole


@pytest.mark.slow
async def test_the_databases_take_turns_one_round_each(databases: list[Any]) -> None:
    """Structurally, not by the clock: while several databases have work, their claims (and
    settles) take turns in rotation, so the quiet ones wait at most one of the busy one's
    (side by side, the busy one's back-to-back rounds kept MongoDB and the publisher busy, and
    the others' p50 went from 0.6 s to 21 s: benchmarks/bench_tenants.py measures it)."""
    busy, *quiet = databases
    busy_outbox = Outbox(busy)
    await busy_outbox.ensure_indexes()
    for order in range(8):
        events = [Event(type="line.added", payload={"n": n}) for n in range(25)]
        await busy_outbox.save_with_events(None, busy.orders, {"_id": order}, events)
    quiet_outboxes = [Outbox(db, mode="embedded", collections=["carts"]) for db in quiet]
    quiet_ids: set[str] = set()
    for outbox, db in zip(quiet_outboxes, quiet, strict=True):
        await outbox.ensure_indexes()
        for cart in range(20):
            saved = await outbox.save_with_events(None, db.carts, {"_id": cart}, [Event(type="x")])
            quiet_ids.add(saved.events[0].id)
    publisher = MemoryPublisher()  # one list, in publication order
    settings = RelaySettings(batch_size=10)
    tenants = TenantRelays(
        [
            PollingRelay(outbox, publisher, settings=settings, interval=0.05)
            for outbox in [busy_outbox, *quiet_outboxes]
        ]
    )
    task = asyncio.ensure_future(tenants.run())
    try:
        await publisher.wait_for(200 + 40, timeout=60)
    finally:
        tenants.stop()
        await asyncio.wait_for(task, 20)
    names = [db.name for db in databases]
    first = list(tenants.turns.history)[:6]
    # A rotation (claims, then settles, of each): each database twice, never one database
    # twice in a row while the others wait.
    assert sorted(first) == sorted(names * 2), first
    assert all(a != b for a, b in itertools.pairwise(first)), first
    order = [e.id for e in publisher.events]
    last_quiet = max(order.index(i) for i in quiet_ids)
    busy_ahead = sum(1 for i in order[:last_quiet] if i not in quiet_ids)
    # The busy one's first round is whole (it was alone), then it claims 10 // 3² = 1 per turn,
    # a turn for each of the 20 the quiet ones claim: at most 10 + 20 (and one in progress),
    # where its whole backlog (200) would have gone first without turns.
    assert busy_ahead <= 10 + 20 + 10, f"{busy_ahead} of the busy database's events went first"


class GatedPublisher:
    """A fake broker in front of the real ``MemoryPublisher``: the first publish of an event
    of ``gated_type`` waits for ``gate()`` before it goes through; every other publish goes
    through at once. It stands for a broker slow to confirm one tenant's wave."""

    def __init__(self, gated_type: str, gate: Any) -> None:
        self.inner = MemoryPublisher()
        self.gated_type = gated_type
        self.gate = gate
        self.gated = False

    async def publish(self, event: Event) -> None:
        if event.type == self.gated_type and not self.gated:
            self.gated = True
            await self.gate()
        await self.inner.publish(event)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.slow
async def test_two_trickling_tenants_publish_before_a_backlogs_round_of_many_waves_ends(
    databases: list[Any],
) -> None:
    """By the order of events, not by the clock: the backlog database's round of ten waves
    (one order of ten events: a round beside other tenants starts at one document) is held at
    its first wave until both trickling databases' events, saved only then, are published.
    Were their claims to wait for that round to end (its waves or its settle holding the turn
    they need), nothing would move and the test would fail at its deadline; a loaded machine
    only makes it slower."""
    busy, *quiet = databases
    outboxes = [Outbox(db, mode="embedded", collections=["orders"]) for db in databases]
    for outbox in outboxes:
        await outbox.ensure_indexes()
    for key in range(4):
        events = [Event(type="line.added", payload={"n": n}) for n in range(10)]
        await outboxes[0].save_with_events(None, busy.orders, {"_id": key}, events)
    quiet_ids: list[str] = []

    async def gate() -> None:
        # The backlog's first wave is under way: now the two other databases each save one.
        for outbox, db in zip(outboxes[1:], quiet, strict=True):
            saved = await outbox.save_with_events(
                None, db.orders, {"_id": "trickle"}, [Event(type="opened")]
            )
            quiet_ids.append(saved.events[0].id)
        await until(lambda: set(quiet_ids) <= {e.id for e in publisher.inner.events}, timeout=120)

    publisher = GatedPublisher("line.added", gate)
    # A publish may wait for the gate that long: nothing else may cut the round short.
    settings = {"publish_timeout": 150.0, "claim_lease": 600.0}
    tenants = TenantRelays([relay(outbox, publisher, **settings) for outbox in outboxes])
    task = asyncio.ensure_future(tenants.run())
    try:
        await publisher.inner.wait_for(40 + 2, timeout=180)
    finally:
        tenants.stop()
        await asyncio.wait_for(task, 30)
    published = publisher.inner.events
    ids = [e.id for e in published]
    first_round = [e for e in published if e.type == "line.added"][:10]
    # The round's ten waves are one order's ten events, in their order.
    assert [e.payload["n"] for e in first_round] == list(range(10))
    last_wave = ids.index(first_round[-1].id)
    assert all(ids.index(i) < last_wave for i in quiet_ids), (quiet_ids, ids)
    assert len(set(ids)) == 42  # every event once
    for key in range(4):  # every order's events in order
        ns = [e.payload["n"] for e in published if str(e.aggregate_id) == str(key)]
        assert ns == list(range(10))
