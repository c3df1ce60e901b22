"""A round of any batch_size sends commands of bounded size: its claim, order check and settle
name at most IDS_PER_COMMAND ids (or aggregates) per statement. One updateMany naming 70k long
ids outgrew MongoDB's 16 MiB: PyMongo raised DocumentTooLarge, which is no PyMongoError, so
run() ended for good. Here with 5 per command, so that 40 entries show it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import bson
import pytest
from pymongo import AsyncMongoClient, monitoring

from mongo_outbox import Event, PollingRelay, RelaySettings, _commands
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher
from tests.support.outboxes import MODES, assert_in_order, make_outbox
from tests.support.servers import MongoServer

PER_COMMAND = 5


class Statements(monitoring.CommandListener):
    """Every statement the client sends, encoded: each op of a write (the driver splits a
    bulk into commands by size, never one op), the filter of a read."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        command = event.command
        for key in ("updates", "deletes", "documents"):
            self.sent += [bson.encode(op) for op in command.get(key) or []]
        for key in ("filter", "pipeline"):
            if key in command:
                self.sent.append(bson.encode({key: command[key]}))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.mark.parametrize("mode", MODES)
async def test_a_round_larger_than_a_command_goes_out_in_bounded_commands(
    db: Any, mongo: MongoServer, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_commands, "IDS_PER_COMMAND", PER_COMMAND, raising=False)
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    saved: list[Event] = []
    for n in range(30):
        events = [Event(type="e") for _ in range(3 if n == 0 else 1)]
        saved += (
            await outbox.save_with_events(None, db.orders, {"_id": f"order-{n:03}"}, events)
        ).events
    names = [e.id.encode() for e in saved] + [f"order-{n:03}".encode() for n in range(30)]
    listener = Statements()
    watched: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, tz_aware=True, event_listeners=[listener]
    )
    publisher = MemoryPublisher()
    try:
        relay = PollingRelay(
            make_outbox(watched[db.name], mode), publisher, settings=RelaySettings(batch_size=40)
        )
        published, _ = await relay.publish_batch()
    finally:
        await watched.close()
    assert published == len(saved)  # one round
    assert_in_order(publisher.events, saved, once=True)
    named = [sum(name in statement for name in names) for statement in listener.sent]
    assert max(named) <= PER_COMMAND, f"a statement names {max(named)} ids"


async def test_what_waits_behind_a_blocker_is_released_in_bounded_commands(
    db: Any, mongo: MongoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_commands, "IDS_PER_COMMAND", PER_COMMAND, raising=False)
    outbox = make_outbox(db, "collection")
    await outbox.ensure_indexes()
    events = [Event(type="e") for _ in range(13)]
    saved = (await outbox.save_with_events(None, db.orders, {"_id": "a"}, events)).events
    leased = {"claim": "another relay's", "available_at": utc_now() + timedelta(minutes=1)}
    await db.outbox.update_one({"_id": saved[0].id}, {"$set": leased})
    listener = Statements()
    watched: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, tz_aware=True, event_listeners=[listener]
    )
    try:
        relay = PollingRelay(make_outbox(watched[db.name]), MemoryPublisher())
        assert (await relay.publish_batch())[0] == 0
    finally:
        await watched.close()
    held = await db.outbox.count_documents({"claim": {"$ne": None}})
    assert held == 1  # the blocker, still another relay's: the 12 behind it were released
    names = [e.id.encode() for e in saved]
    assert max(sum(n in s for n in names) for s in listener.sent) <= PER_COMMAND
