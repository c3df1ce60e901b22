"""Partitioned outboxes and relay groups, in process: where the partition is stored, the
recorded partition count, and members that share, rebalance and hand partitions over."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from pymongo import MongoClient

from mongo_outbox import ConfigurationError, Event, Outbox, RelayGroup, RelaySettings
from mongo_outbox import sync as sync_api
from mongo_outbox._partitions import partition_of
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher
from tests.support.outboxes import MODES, assert_in_order, make_outbox, save_history
from tests.support.waiting import drained, until
from tests.support.writers import save_concurrently

pytestmark = pytest.mark.parametrize("mode", MODES)

FAST = RelaySettings(claim_lease=2.0, publish_timeout=0.5)


def group(outbox: Outbox, publisher: MemoryPublisher, **options: Any) -> RelayGroup:
    return RelayGroup(outbox, publisher, member_lease=3.0, interval=0.05, settings=FAST, **options)


async def stop_all(members: list[RelayGroup], tasks: list[asyncio.Task[None]]) -> None:
    """Stop the members (also after a failed assertion: the test loop outlives the test, and
    a member left running would go on writing beside the next tests)."""
    for member in members:
        member.stop()
    _, pending = await asyncio.wait(tasks, timeout=20)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert not pending, "a member did not stop within 20 s"


async def stored_partitions(db: Any, outbox: Outbox) -> dict[Any, set[Any]]:
    """The partition stored with each aggregate's entries, by aggregate id."""
    found: dict[Any, set[Any]] = {}
    if outbox.mode == "collection":
        async for entry in db.outbox.find():
            found.setdefault(entry["aggregate_id"], set()).add(entry.get("partition"))
    else:
        async for doc in db.orders.find():
            found.setdefault(doc["_id"], set()).add(doc.get(outbox.partition_field))
    return found


def test_the_partition_is_the_same_in_every_process(mode: str) -> None:
    """hash() is salted per process; the partition must not be: two interpreters with other
    hash seeds compute the same partitions as this one."""
    keys = [("orders", "o-1"), ("orders", 7), ("Order", "x" * 40)]
    here = [partition_of(t, i, 16) for t, i in keys]
    code = (
        "from mongo_outbox._partitions import partition_of;"
        f"print([partition_of(t, i, 16) for t, i in {keys!r}])"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == str(here)
    # And it spreads: 1,000 aggregates over 4 partitions, none far from a quarter.
    spread = Counter(partition_of("orders", n, 4) for n in range(1000))
    assert set(spread) == {0, 1, 2, 3} and min(spread.values()) > 180


async def test_saves_store_the_partition_with_the_entries(
    db: Any, mode: str, sync_client: MongoClient[Any]
) -> None:
    outbox = make_outbox(db, mode, partitions=4)
    await save_history(outbox, db, aggregates=12, saves=2)
    await outbox.update_with_events(
        None, db.orders, {"_id": 3}, {"$set": {"x": 1}}, [Event(type="u")]
    )
    # The sync API stores the same numbers by the same rules.
    sync_outbox = sync_api.Outbox(
        sync_client[db.name],
        mode=mode,
        collections=["orders"],
        partitions=4,  # type: ignore[arg-type]
    )
    sync_outbox.save_with_events(None, sync_client[db.name].orders, {"_id": 20}, [Event(type="s")])
    found = await stored_partitions(db, outbox)
    assert set(found) == {*range(12), 20}
    for aggregate, partitions in found.items():
        assert partitions == {partition_of("orders", aggregate, 4)}


async def test_a_writer_or_group_with_another_partition_count_is_refused(
    db: Any, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="mongo_outbox"):
        await make_outbox(db, mode, partitions=4).ensure_indexes()
        await make_outbox(db, mode, partitions=4).ensure_indexes()  # recorded already: quiet
    assert (await db.outbox_config.find_one({"_id": "partitions"}))["count"] == 4
    # Recording it is said once: from then on every writer and relay must use it.
    [said] = [r.getMessage() for r in caplog.records if "recorded partitions" in r.getMessage()]
    assert said.endswith(
        "recorded partitions=4 in outbox_config: every writer and relay of this outbox must now "
        "use partitions=4 (docs/groups.md says how to change it)"
    )
    for count in (1, 8):
        other = make_outbox(db, mode, partitions=count)
        with pytest.raises(ConfigurationError, match="records partitions=4"):
            await other.save_with_events(None, db.orders, {"_id": 1}, [Event(type="e")])
        with pytest.raises(ConfigurationError, match="partitions"):
            await group(other, MemoryPublisher()).run()
    assert await db.orders.count_documents({}) == 0  # refused before anything was written


class Witness(MemoryPublisher):
    """A MemoryPublisher that notes every publish its member made of a partition whose lease
    it did not hold at that moment (there must be none)."""

    def __init__(self, log: list[Event]) -> None:
        super().__init__()
        self.member: RelayGroup | None = None
        self.unfenced: list[Event] = []
        self.log = log  # shared by the members: the order the broker saw

    async def publish(self, event: Event) -> None:
        assert self.member is not None
        k = self.member.outbox.partition_of(event.aggregate_type, event.aggregate_id)
        if self.member.fence(k) is None:
            self.unfenced.append(event)
        await super().publish(event)
        self.log.append(event)


async def save_beside(outbox: Outbox, db: Any, orders: int) -> list[Event]:
    """One event for each of ``orders`` new orders, saved by concurrent writers while the
    members run (tests/support/writers.py): every save commits."""
    return await save_concurrently(outbox, db, orders, aggregates=orders, first_order=1000)


@pytest.mark.slow
async def test_two_members_share_the_partitions_and_hand_them_over(
    db: Any, mode: str, mongo: Any
) -> None:
    outbox = make_outbox(db, mode, partitions=4)
    await outbox.ensure_indexes()
    saved = await save_history(outbox, db, aggregates=20, saves=3)
    published: list[Event] = []
    first, second = Witness(published), Witness(published)
    a, b = group(outbox, first), group(outbox, second)
    first.member, second.member = a, b
    tasks = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    try:

        async def shared() -> bool:
            return len(a.owned) == 2 and len(b.owned) == 2

        await until(shared, timeout=30)
        assert set(a.owned) | set(b.owned) == {0, 1, 2, 3}

        def unpublished(events: list[Event], *members: Witness) -> Callable[[], Awaitable[int]]:
            async def left() -> int:
                return len({e.id for e in events} - {e.id for m in members for e in m.events})

            return left

        # Stalls, not deadlines: a loaded machine drains slowly, a lost entry not at all.
        await drained(unpublished(saved, first, second))

        async def status_tells() -> bool:
            # A renewal late on a loaded machine makes a member stand by and take its partition
            # again: wait for a moment when the leases say what the members hold.
            status = await a.status()
            members = (await b.status()).members
            return (
                status.owners
                == {**dict.fromkeys(a.owned, a.member), **dict.fromkeys(b.owned, b.member)}
                and status.owned == tuple(a.owned)
                and status.pending == 0
                # Each heartbeat says what its member held then: the next ones say it as it is now.
                and members == {a.member: tuple(a.owned), b.member: tuple(b.owned)}
            )

        await until(status_tells, timeout=10)
        # b stops: it gives its partitions back, a takes them all and publishes what comes next.
        b.stop()
        await asyncio.wait_for(tasks[1], 10)
        await until(lambda: len(a.owned) == 4, timeout=20)
        committed = await save_beside(outbox, db, 20)
        await drained(unpublished(committed, first))
        a.stop()
        await asyncio.wait_for(tasks[0], 10)
        assert not first.unfenced and not second.unfenced
        assert_in_order(published, saved + committed, once=False)
        # Stopped members gave their leases back and left.
        live = await db.outbox_relays.find({"lease_until": {"$gt": utc_now()}}).to_list(None)
        assert not live, (live, a.member, b.member)
        members = await db.outbox_relay_members.find().to_list(None)
        assert not members, members
    finally:
        await stop_all([a, b], tasks)


async def test_change_stream_members_follow_their_partitions_with_a_checkpoint_each(
    db: Any, mode: str, mongo: Any
) -> None:
    outbox = make_outbox(db, mode, partitions=4)
    await outbox.ensure_indexes()
    saved = await save_history(outbox, db, aggregates=12, saves=2)
    published: list[Event] = []
    first, second = Witness(published), Witness(published)
    a = group(outbox, first, source="changestream")
    b = group(outbox, second, source="changestream")
    first.member, second.member = a, b
    tasks = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    try:

        async def shared() -> bool:
            return len(a.owned) == 2 and len(b.owned) == 2

        await until(shared, timeout=30)
        await until(lambda: {e.id for e in saved} <= {e.id for e in published}, 30)
        # What is written now comes through the partitions' streams.
        committed = await save_beside(outbox, db, 12)
        await until(lambda: {e.id for e in committed} <= {e.id for e in published}, 30)

        async def checkpointed() -> bool:
            names = [f"relay-group/{k}" for k in range(4)]
            docs = await db.outbox_relays.find({"_id": {"$in": names}}).to_list(None)
            return len(docs) == 4 and all(d.get("token") for d in docs)

        await until(checkpointed, timeout=30)
        for member in (a, b):
            member.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        assert not first.unfenced and not second.unfenced
        assert_in_order(published, saved + committed, once=False)
    finally:
        await stop_all([a, b], tasks)


@pytest.mark.parametrize("source", ["polling", "changestream"])
async def test_a_group_publishes_entries_saved_without_partitions(
    db: Any, mode: str, source: Any, mongo: Any
) -> None:
    """Entries saved before the outbox had partitions, and by a writer that read the record
    before it existed, get their aggregate's partition and are published in order: the
    backlog drains to 0 (they used to wait, unclaimed by any partition, for ever)."""
    before = make_outbox(db, mode)  # partitions=1: it records nothing and stores none
    saved = await save_history(before, db, aggregates=5, saves=2)
    outbox = make_outbox(db, mode, partitions=4)
    await outbox.ensure_indexes()
    publisher = MemoryPublisher()
    member = group(outbox, publisher, source=source)
    task = asyncio.create_task(member.run())
    late: list[Event] = []
    try:
        await until(lambda: len(publisher.events) >= len(saved), 30)
        # ``before`` checked the record once, before there was one: it still stores none. A
        # polling group assigns them within a beat (a change-stream group at its next sweep).
        # Not on the emulator in collection mode: a save beside a relay there may conflict.
        if source == "polling" and (mode == "embedded" or mongo.kind != "emulator"):
            late = await save_history(before, db, aggregates=7, saves=1)

        async def drained() -> bool:
            status = await member.status()
            return len(publisher.events) >= len(saved + late) and status.pending == 0

        await until(drained, 30)
    finally:
        await stop_all([member], [task])
    assert_in_order(publisher.events, saved + late, once=True)
    partitions = await stored_partitions(db, outbox)
    assert all(found == {partition_of("orders", i, 4)} for i, found in partitions.items())


async def test_a_partition_whose_change_stream_mongodb_refuses_fails_the_member(
    db: Any, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fatal change-stream error (not authorized: no retry can fix it) in one partition's
    relay made the member start that partition again every beat, an error line a second, while
    the member stayed active and healthy. Now the member gives its partitions back, leaves
    the group and fails with that error, as a relay does."""
    from pymongo.errors import OperationFailure

    from mongo_outbox.changestream.source import WatchSource
    from mongo_outbox.errors import ChangeStreamError

    opened: list[object] = []
    open_stream = WatchSource.open

    async def refused(self: WatchSource, **options: Any) -> Any:
        opened.append(options)
        if len(opened) > 1:  # the first partition's opens; the second's is refused
            raise OperationFailure("not authorized on shop to execute command", code=13)
        return await open_stream(self, **options)

    monkeypatch.setattr(WatchSource, "open", refused)
    outbox = make_outbox(db, mode, partitions=2)
    await outbox.ensure_indexes()
    member = group(outbox, MemoryPublisher(), source="changestream")
    with pytest.raises(ChangeStreamError, match="not authorized"):
        await asyncio.wait_for(member.run(), 30)
    assert member.state == "failed" and "not authorized" in (member.last_error or "")
    assert len(opened) == 2  # not again, every beat
    assert member.owned == []
    assert await db.outbox_relay_members.count_documents({}) == 0  # it left the group
