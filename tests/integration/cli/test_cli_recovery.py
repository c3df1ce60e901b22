"""``mongo-outbox parked``, ``inbox`` and ``ensure-indexes``, the real console script against
the test MongoDB: dead-lettered events and messages are listed, shown and requeued, and a
requeue never breaks an aggregate's order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mongo_outbox import (
    Event,
    Inbox,
    Outbox,
    Outcome,
    PoisonMessage,
    PollingRelay,
    RelaySettings,
    inbox_guard,
)
from mongo_outbox.publishers import MemoryPublisher
from tests.support.cli import cli
from tests.support.servers import MongoServer

MODES = ["collection", "embedded"]


def target(mongo: MongoServer, db: Any, mode: str = "collection") -> list[str]:
    return [f"--uri={mongo.uri}", f"--db={db.name}", f"--mode={mode}", "--collections=orders"]


async def park(db: Any, mode: str) -> dict[str, list[Event]]:
    """Aggregate a: a poison event then a good one; b: one "bad" event; c: two poison events."""
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    saved: dict[str, list[Event]] = {}
    for doc_id, types in (("a", ["poison", "placed"]), ("b", ["bad"]), ("c", ["poison", "poison"])):
        # c's second event is of its type's version 2: listings show which version parked.
        events = [Event(type=t, version=i + 1 if doc_id == "c" else 1) for i, t in enumerate(types)]
        saved[doc_id] = (
            await outbox.save_with_events(None, db.orders, {"_id": doc_id}, events)
        ).events
    broken = MemoryPublisher(
        fail=lambda e: None if e.type == "placed" else ValueError("cannot encode")
    )
    await PollingRelay(outbox, broken, settings=RelaySettings(max_attempts=1)).drain()
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
async def test_parked_events_are_listed_shown_and_requeued_in_order(
    mongo: MongoServer, db: Any, mode: str
) -> None:
    saved = await park(db, mode)
    where = target(mongo, db, mode)
    a_poison, b_bad = saved["a"][0], saved["b"][0]
    c_first, c_second = saved["c"]

    listed = await cli("parked", "list", *where)
    assert listed.code == 0, listed.output
    ids = {line.split()[0] for line in listed.out.splitlines()[1:]}
    assert ids == {a_poison.id, b_bad.id, c_first.id, c_second.id}
    assert "cannot encode" in listed.out
    # Which version each parked event is, as `inbox failed` shows (c's second is v2).
    header, *rows = listed.out.splitlines()
    assert header.split()[:4] == ["EVENT", "ID", "TYPE", "VERSION"]
    assert {row.split()[0]: row.split()[2] for row in rows} == {
        a_poison.id: "v1",
        b_bad.id: "v1",
        c_first.id: "v1",
        c_second.id: "v2",
    }
    only_bad = json.loads((await cli("parked", "list", *where, "--type=bad", "--json")).out)
    assert [e["_id"] for e in only_bad] == [b_bad.id]
    of_c = json.loads((await cli("parked", "list", *where, "--aggregate=c", "--json")).out)
    assert sorted(e["sequence"] for e in of_c) == [1, 2]

    shown = await cli("parked", "show", *where, c_second.id)
    assert shown.code == 0 and "cannot encode" in shown.out and "sequence" in shown.out
    assert [line.split() for line in shown.out.splitlines() if line.startswith("version ")] == [
        ["version", "2"]
    ]
    entry = json.loads((await cli("parked", "show", *where, c_second.id, "--json")).out)
    assert entry["_id"] == c_second.id and entry["attempts"] == 1 and entry["version"] == 2
    missing = await cli("parked", "show", *where, "no-such-id")
    assert missing.code == 1 and missing.err.strip() == "mongo-outbox: no parked event 'no-such-id'"

    for wrong in ([], ["--all", c_first.id], ["--all", "--type=bad"], ["no-such-id"]):
        refused = await cli("parked", "requeue", *where, *wrong)
        assert refused.code == 1 and len(refused.err.splitlines()) == 1, refused.output
    # A misspelled type or aggregate is refused, not reported as a requeue of nothing.
    for misspelled in (["--type=badd"], ["--aggregate=no-such-order"]):
        refused = await cli("parked", "requeue", *where, *misspelled)
        assert refused.code == 1, refused.output
        assert "no parked event matches: nothing was requeued (parked types: " in refused.err
    assert len(json.loads((await cli("parked", "list", *where, "--json")).out)) == 4

    # The later of c's two parked events brings the earlier one back, so it cannot overtake it.
    ran = await cli("parked", "requeue", *where, c_second.id)
    assert (
        ran.out.strip()
        == "requeued 1 parked events, and 1 earlier parked events of their aggregates"
    )
    assert (await cli("parked", "requeue", *where, "--type=bad")).out.strip() == (
        "requeued 1 parked events"
    )
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 3
    assert [e.id for e in publisher.events if e.aggregate_id == "c"] == [c_first.id, c_second.id]
    assert (
        await cli("parked", "requeue", *where, "--all")
    ).out.strip() == "requeued 1 parked events"
    assert (await cli("parked", "list", *where)).out.strip() == "no parked events"
    nothing = await cli("parked", "requeue", *where, "--all")
    assert nothing.code == 1 and "(none is parked)" in nothing.err, nothing.output


async def dead_letter(db: Any, consumer: str, *events: Event) -> None:
    @inbox_guard(Inbox(db, consumer=consumer, transactional=False))
    async def broken(event: Event, session: Any) -> None:
        raise PoisonMessage("the bug")

    for event in events:
        assert (await broken.handle(event)).outcome is Outcome.DEAD_LETTERED


@pytest.mark.slow
async def test_inbox_failures_are_listed_and_requeued_for_their_next_delivery(
    mongo: MongoServer, db: Any
) -> None:
    placed = [Event(type="order.placed") for _ in range(2)]
    paid = Event(type="order.paid", version=3)
    await dead_letter(db, "billing", *placed, paid)
    await dead_letter(db, "mailer", placed[0])
    where = target(mongo, db)

    listed = await cli("inbox", "failed", *where)
    assert listed.code == 0, listed.output
    assert listed.out.split()[:4] == ["CONSUMER", "MESSAGE", "ID", "TYPE"]
    rows = [line.split()[:4] for line in listed.out.splitlines()[1:]]
    assert sorted(rows) == sorted(
        [["billing", e.id, e.type, f"v{e.version}"] for e in [*placed, paid]]
        + [["mailer", placed[0].id, "order.placed", "v1"]]
    )
    chosen = await cli(
        "inbox", "failed", *where, "--consumer=billing", "--type=order.paid", "--json"
    )
    [record] = json.loads(chosen.out)
    assert record["message_id"] == paid.id and "the bug" in record["last_error"]
    assert len(json.loads((await cli("inbox", "failed", *where, "--since=1h", "--json")).out)) == 4
    later = await cli("inbox", "failed", *where, "--since=2999-01-01T00:00:00Z")
    assert later.out.strip() == "no failed messages"
    misspelled = await cli("inbox", "failed", *where, "--consumer=biling")
    assert misspelled.code == 0 and misspelled.out.strip() == (
        "no failed messages; biling has none, these consumers have failed messages: "
        "billing (3), mailer (1)"
    )
    bad_time = await cli("inbox", "failed", *where, "--since=yesterday")
    assert bad_time.code == 1 and "--since" in bad_time.err

    refused = await cli("inbox", "requeue", *where, "--consumer=billing")
    assert refused.code == 1 and "choose what to requeue" in refused.err
    ran = await cli("inbox", "requeue", *where, "--consumer=billing", "--type=order.placed")
    assert ran.code == 0 and ran.out.startswith("requeued 2 failed messages of billing")

    handled: list[str] = []

    @inbox_guard(Inbox(db, consumer="billing", transactional=False))
    async def fixed(event: Event, session: Any) -> None:
        handled.append(event.id)

    assert [(await fixed.handle(e)).outcome for e in [*placed, paid]] == [
        Outcome.HANDLED,
        Outcome.HANDLED,
        Outcome.DUPLICATE,  # still dead-lettered: not requeued
    ]
    assert handled == [e.id for e in placed]
    rest = await cli("inbox", "requeue", *where, "--consumer=billing", "--all")
    assert rest.out.startswith("requeued 1 failed messages of billing")
    assert len(await Inbox(db, consumer="mailer").failed()) == 1


@pytest.mark.parametrize("mode", MODES)
async def test_ensure_indexes_creates_the_outbox_and_inbox_indexes(
    mongo: MongoServer, db: Any, mode: str
) -> None:
    ran = await cli("ensure-indexes", *target(mongo, db, mode), "--inbox")
    assert ran.code == 0, ran.output
    lines = dict(line.split(": ", 1) for line in ran.out.splitlines())
    if mode == "collection":
        assert (
            lines[f"{db.name}.outbox"] == "aggregate, aggregate_sequence, relay_due, ttl, waiting"
        )
    else:
        assert lines[f"{db.name}.orders"] == "_outbox_parked, _outbox_relay_due, _outbox_wait"
        assert lines[f"{db.name}.outbox_event_ids"] == "ttl"
    assert lines[f"{db.name}.inbox"] == "failures, identity, ttl"
    assert "failures" in await db.inbox.index_information()
    again = await cli("ensure-indexes", *target(mongo, db, mode), "--inbox")
    assert again.out == ran.out  # idempotent


async def test_ensure_indexes_over_duplicate_sequences_builds_the_others_and_names_them(
    mongo: MongoServer, db: Any
) -> None:
    entry = {"aggregate_type": "orders", "aggregate_id": "o1", "sequence": 1}
    await db.outbox.insert_many([{"_id": "e1", **entry}, {"_id": "e2", **entry}])
    ran = await cli("ensure-indexes", *target(mongo, db), "--inbox")
    assert ran.code == 1
    assert "orders 'o1' sequence 1 (entries e1, e2)" in ran.output
    outbox = await db.outbox.index_information()
    assert "aggregate_sequence" not in outbox and "relay_due" in outbox
    # The inbox's are built too: the outbox's refusal used to end the command first.
    assert {"failures", "identity", "ttl"} <= set(await db.inbox.index_information())


async def test_an_inbox_requeue_that_requeues_nothing_fails_and_changes_nothing(
    mongo: MongoServer, db: Any
) -> None:
    placed, paid = Event(type="order.placed"), Event(type="order.paid")
    await dead_letter(db, "billing", placed, paid)
    where = target(mongo, db)

    unknown = await cli("inbox", "requeue", *where, "--consumer=billing", placed.id, "no-such-id")
    assert unknown.code == 1, unknown.output
    assert "not a failed message of billing: no-such-id (nothing was requeued)" in unknown.err
    misspelled = await cli("inbox", "requeue", *where, "--consumer=biling", "--all")
    assert misspelled.code == 1, misspelled.output
    assert "no failed messages of biling to requeue" in misspelled.err
    assert "these consumers have failed messages: billing (2)" in misspelled.err
    no_type = await cli("inbox", "requeue", *where, "--consumer=billing", "--type=order.paidd")
    assert no_type.code == 1 and "of type order.paidd" in no_type.err, no_type.output

    assert len(await Inbox(db, consumer="billing").failed()) == 2
    ran = await cli("inbox", "requeue", *where, "--consumer=billing", placed.id)
    assert ran.code == 0 and ran.out.startswith("requeued 1 failed messages of billing")
