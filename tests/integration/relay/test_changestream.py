"""ChangeStreamRelay: checkpoints, recovery, leadership, parking, against the session's MongoDB
with a scripted change source, and against real change streams (mongoeco in process)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from pymongo.errors import AutoReconnect, OperationFailure

from mongo_outbox import (
    Backoff,
    ChangeStreamError,
    ChangeStreamRelay,
    Event,
    Outbox,
    RelaySettings,
)
from mongo_outbox.changestream import ChangeBatch
from mongo_outbox.publishers import MemoryPublisher, NatsPublisher
from tests.support.changestream_sources import MongoEcoSource, ScriptedSource, inserts
from tests.support.outboxes import save_aborted
from tests.support.servers import NATS_URL
from tests.support.waiting import LoopStalls, awaiting, drained, progressing, until

FAST = Backoff(initial=0.01, maximum=0.05)
ROOT = Path(__file__).resolve().parents[3]


async def save(outbox: Outbox, db: Any, count: int, start: int = 0) -> list[dict[str, Any]]:
    """Save ``count`` one-event orders; return their outbox documents, as a stream shows them.

    The tests save only while the relay under test does not write: the emulator lets a
    transaction that conflicted at commit leave its writes behind (see docs/testing.md)."""
    ids = []
    for n in range(start, start + count):
        saved = await outbox.save_with_events(None, db.orders, {"_id": n}, [Event(type="placed")])
        ids += [e.id for e in saved.events]
    return list(await db.outbox.find({"_id": {"$in": ids}}).sort("_id", 1).to_list(None))


def relay(outbox: Outbox, publisher: Any, source: Any, **options: Any) -> ChangeStreamRelay:
    """A relay of this module's name; ``options`` mixes its own and RelaySettings' keywords."""
    options = {"leader_lease": 30.0, "sweep_interval": 60.0} | options
    tuning = {k: options.pop(k) for k in list(options) if k in RelaySettings.__dataclass_fields__}
    return ChangeStreamRelay(
        outbox,
        publisher,
        name="orders-relay",
        source=source,
        settings=RelaySettings(**({"backoff": FAST} | tuning)),
        **options,
    )


@pytest.fixture
async def outbox(db: Any) -> Outbox:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    return outbox


async def running(relay: ChangeStreamRelay) -> asyncio.Task[None]:
    return asyncio.create_task(relay.run())


async def stopped(relay: ChangeStreamRelay, task: asyncio.Task[None]) -> None:
    relay.stop()
    await asyncio.wait_for(task, 10)


async def checkpoint(db: Any) -> dict[str, Any]:
    return await db.outbox_relays.find_one({"_id": "orders-relay"}) or {}


async def test_first_start_sweeps_then_follows_and_checkpoints(db: Any, outbox: Outbox) -> None:
    before = await save(outbox, db, 2)
    source, publisher = ScriptedSource(), MemoryPublisher()
    r = relay(outbox, publisher, source)
    task = await running(r)
    await publisher.wait_for(2)  # the sweep found what was pending before the stream existed

    async def watching() -> bool:
        return bool(source.opens)

    await until(watching)
    assert source.cluster_times == 1
    assert source.opens == [{"resume_after": None, "start_at": "T1"}]
    after = await save(outbox, db, 3, start=2)
    source.play(inserts(after, "t1"))
    await publisher.wait_for(5)

    async def checkpointed() -> bool:
        return (await checkpoint(db)).get("token") == {"_data": "t1"}

    await until(checkpointed)
    await stopped(r, task)
    assert [e.id for e in publisher.events] == [d["_id"] for d in before + after]
    assert await db.outbox.count_documents({"status": "published"}) == 5
    status = await r.status()
    assert status.pending == 0 and status.parked == 0 and status.last_checkpoint_at is not None
    assert status.recoveries == 0  # a first start has nothing to recover


async def test_a_busy_writer_cannot_keep_the_recovery_sweeping(db: Any, outbox: Outbox) -> None:
    """A commit follows every broker confirm while the recovery sweeps. The sweep takes what was
    due when it began, then hands over to the stream, which has everything committed later."""
    await save(outbox, db, 3)
    source = ScriptedSource()
    written: list[dict[str, Any]] = []

    one_at_a_time = asyncio.Lock()  # one save per publish, in turn: the count below is exact

    class BusyWriter(MemoryPublisher):
        async def publish(self, event: Event) -> None:
            await super().publish(event)
            async with one_at_a_time:
                if not source.opens and len(written) < 30:
                    written.extend(await save(outbox, db, 1, start=100 + len(written)))

    async def watching() -> bool:
        return bool(source.opens)

    r = relay(outbox, BusyWriter(), source)
    task = await running(r)
    await until(watching)
    await stopped(r, task)
    assert len(written) == 3  # one commit per entry that was due; a chasing sweep makes 30


async def test_restart_resumes_from_the_checkpoint_without_a_sweep(db: Any, outbox: Outbox) -> None:
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t7"}, "fence": 3})
    entries = await save(outbox, db, 2)
    source, publisher = ScriptedSource(), MemoryPublisher()
    r = relay(outbox, publisher, source)
    task = await running(r)
    source.play(inserts(entries, "t8"))
    await publisher.wait_for(2)
    await stopped(r, task)
    assert source.opens[0] == {"resume_after": {"_data": "t7"}, "start_at": None}
    assert source.cluster_times == 0
    assert (await checkpoint(db))["fence"] > 3  # taking the lease moved the fence on


@pytest.mark.parametrize("code", [286, 260])
async def test_unusable_token_and_invalidate_recover_by_sweeping(
    db: Any, outbox: Outbox, code: int
) -> None:
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "old"}})
    missed = await save(outbox, db, 2)  # committed while nothing watched: only a sweep finds them
    source, publisher = ScriptedSource(), MemoryPublisher()
    source.open_errors.append(OperationFailure("history lost", code=code))
    r = relay(outbox, publisher, source)
    task = await running(r)
    await publisher.wait_for(2)

    async def watching() -> bool:
        return source.opens[-1] == {"resume_after": None, "start_at": "T1"}

    await until(watching)
    r.stop()  # pause it to commit more while nothing watches, then invalidate the stream
    await asyncio.wait_for(task, 10)
    more = await save(outbox, db, 2, start=2)
    task = await running(r)
    source.play(ChangeBatch([{"operationType": "invalidate"}], None))
    await publisher.wait_for(4)  # the second recovery's sweep published them
    await stopped(r, task)
    assert source.cluster_times == 2
    assert {e.id for e in publisher.events} == {d["_id"] for d in missed + more}


async def test_resumable_error_resumes_from_the_checkpoint(db: Any, outbox: Outbox) -> None:
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    first, second = await save(outbox, db, 1), await save(outbox, db, 1, start=1)
    source, publisher = ScriptedSource(), MemoryPublisher()
    r = relay(outbox, publisher, source)
    task = await running(r)
    source.play(inserts(first, "t1"), AutoReconnect("primary stepped down"))
    await publisher.wait_for(1)

    async def reopened() -> bool:
        return len(source.opens) == 2

    await until(reopened)
    source.play(inserts(second, "t2"))
    await publisher.wait_for(2)
    await stopped(r, task)
    assert source.opens[1] == {"resume_after": {"_data": "t1"}, "start_at": None}


async def test_the_backoff_starts_over_once_the_stream_answers_again(
    db: Any, outbox: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each blip of a long-running relay is its first in a row: it waited as if it were the
    # nth of its life (up to 300 s at the defaults, publishing nothing).
    attempts: list[int] = []
    monkeypatch.setattr(Backoff, "delay", lambda self, attempt: attempts.append(attempt) or 0.01)
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    docs = await save(outbox, db, 3)
    source, publisher = ScriptedSource(), MemoryPublisher()
    r = relay(outbox, publisher, source, leader_lease=1.0)
    task = await running(r)
    for n, doc in enumerate(docs):
        source.play(AutoReconnect("primary stepped down"), inserts([doc], f"t{n + 1}"))
        await publisher.wait_for(n + 1)
        await asyncio.sleep(1.2)  # it follows the stream a lease long: the next is a first
    await stopped(r, task)
    assert attempts == [1, 1, 1]


async def test_the_backoff_grows_for_an_error_that_comes_back_as_soon_as_it_follows(
    db: Any, outbox: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Say a privilege or a validator refuses each of its writes: the stream answers, then the
    # same error. Starting over at every answer, it looped a warning every second.
    attempts: list[int] = []
    monkeypatch.setattr(Backoff, "delay", lambda self, attempt: attempts.append(attempt) or 0.01)
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    source = ScriptedSource()
    for n in range(4):
        source.play(ChangeBatch([], {"_data": f"t{n}"}), AutoReconnect("refused again"))
    r = relay(outbox, MemoryPublisher(), source)
    task = await running(r)
    await until(lambda: len(attempts) == 4)
    await stopped(r, task)
    assert attempts == [1, 2, 3, 4]


async def test_a_relay_backing_off_after_a_stream_error_is_on_standby(
    db: Any, outbox: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its lease is no longer renewed while it waits: "active" would count it as the leader
    # while another relay may take the lease over.
    monkeypatch.setattr(Backoff, "delay", lambda self, attempt: 30.0)
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    source = ScriptedSource()
    r = relay(outbox, MemoryPublisher(), source)
    task = await running(r)
    await until(lambda: r.state == "active")
    source.play(AutoReconnect("primary stepped down"))
    await until(lambda: r.state == "standby")
    status = await r.status()
    assert not status.active and r.last_error is not None and "stepped down" in r.last_error
    await stopped(r, task)  # at once: the wait ends with the stop


async def test_a_resumed_relay_publishes_what_its_checkpoint_moved_past_when_it_is_due(
    db: Any, outbox: Outbox
) -> None:
    # The checkpoint moves past entries whose publish failed (they wait in the outbox for their
    # retry); after a restart they waited a whole sweep_interval, not until their retry.
    await save(outbox, db, 1)
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    source, publisher = ScriptedSource(), MemoryPublisher()
    r = relay(outbox, publisher, source, sweep_interval=60.0)
    task = await running(r)
    await publisher.wait_for(1, timeout=5)
    await stopped(r, task)
    assert source.opens == [{"resume_after": {"_data": "t0"}, "start_at": None}]  # no recovery


async def test_fatal_error_stops_with_a_clear_error(db: Any, outbox: Outbox) -> None:
    source = ScriptedSource()
    source.play(OperationFailure("not authorized on db to execute changeStream", code=13))
    with pytest.raises(ChangeStreamError, match="not authorized"):
        await asyncio.wait_for(relay(outbox, MemoryPublisher(), source).run(), 10)


@pytest.mark.slow
async def test_crash_after_publish_before_checkpoint_loses_nothing(db: Any, outbox: Outbox) -> None:
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    first, second = await save(outbox, db, 2), await save(outbox, db, 2, start=2)
    source = ScriptedSource()
    crashing = MemoryPublisher()
    r1 = relay(outbox, crashing, source, leader_lease=1.0, claim_lease=1.0, publish_timeout=0.5)
    task = await running(r1)
    source.play(inserts(first, "t1"))
    await crashing.wait_for(2)

    async def checkpointed() -> bool:
        return (await checkpoint(db)).get("token") == {"_data": "t1"}

    await until(checkpointed)

    def die_after_confirm(event: Event) -> BaseException | None:
        if event.id == second[0]["_id"]:
            crashing.events.append(event)  # the broker confirmed it ...
            task.cancel()  # ... and the process dies before marking or checkpointing
        return None

    crashing.fail = die_after_confirm
    source.play(inserts(second, "t2"))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await checkpoint(db))["token"] == {"_data": "t1"}

    publisher = MemoryPublisher()
    r2 = relay(outbox, publisher, source, sweep_interval=0.1)
    task2 = await running(r2)  # takes over once r1's lease ran out, resumes after t1
    source.play(inserts(second, "t2"))
    await publisher.wait_for(2, timeout=15)
    await stopped(r2, task2)
    assert source.opens[-1] == {"resume_after": {"_data": "t1"}, "start_at": None}
    assert {e.id for e in publisher.events} == {d["_id"] for d in second}
    assert await db.outbox.count_documents({"status": "published"}) == 4


async def test_one_active_relay_and_a_standby_takes_over(db: Any, outbox: Outbox) -> None:
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    entries = await save(outbox, db, 1)
    leader_source, standby_source = ScriptedSource(), ScriptedSource()
    leader = relay(outbox, MemoryPublisher(), leader_source, leader_lease=0.5)
    standby_publisher = MemoryPublisher()
    standby = relay(outbox, standby_publisher, standby_source, leader_lease=0.5)
    leader_task = await running(leader)

    async def leading() -> bool:
        return (await leader.status()).active

    await until(leading)
    standby_task = await running(standby)
    await asyncio.sleep(0.6)
    assert not (await standby.status()).active and standby_source.opens == []
    assert standby.state == "standby" and leader.state == "active"
    leader_task.cancel()  # the leader dies without a word
    with pytest.raises(asyncio.CancelledError):
        await leader_task
    status = await leader.status()
    assert status.state == "stopped" and not status.active

    async def took_over() -> bool:
        return (await standby.status()).active

    await until(took_over, timeout=3)
    standby_source.play(inserts(entries, "t1"))
    await standby_publisher.wait_for(1)
    await stopped(standby, standby_task)


async def test_poison_entry_is_parked_listed_and_requeued(db: Any, outbox: Outbox) -> None:
    entries = await save(outbox, db, 3)
    poison = entries[1]["_id"]
    broken = True
    publisher = MemoryPublisher(
        fail=lambda e: ValueError("cannot encode") if broken and e.id == poison else None
    )
    source = ScriptedSource()
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    r = relay(outbox, publisher, source, max_attempts=2, sweep_interval=0.05)
    task = await running(r)
    source.play(inserts(entries, "t1"))

    async def parked() -> bool:
        return (await r.status()).parked == 1

    await until(parked)
    assert {e.id for e in publisher.events} == {entries[0]["_id"], entries[2]["_id"]}
    [record] = await r.parked()
    assert record["_id"] == poison and "cannot encode" in record["last_error"]
    assert (await r.status()).publish_failures >= 2
    broken = False
    assert await r.requeue([poison]) == 1
    await publisher.wait_for(3)  # the sweep picked the requeued entry up
    await stopped(r, task)


async def test_embedded_poison_entry_is_parked_in_its_document_and_requeued(db: Any) -> None:
    """Embedded mode on the server's own stream: the poison entry is parked inside its
    aggregate's document, its aggregate's next event goes out, and a requeue publishes it."""
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    await outbox.ensure_indexes()
    saved = await outbox.save_with_events(
        None, db.orders, {"_id": 1}, [Event(type="poison"), Event(type="next")]
    )
    poison, after = saved.events
    broken = True
    publisher = MemoryPublisher(
        fail=lambda e: ValueError("cannot encode") if broken and e.id == poison.id else None
    )
    r = ChangeStreamRelay(
        outbox,
        publisher,
        name="orders-relay",
        settings=RelaySettings(backoff=FAST, max_attempts=2),
        sweep_interval=0.05,
    )
    task = await running(r)

    async def parked() -> bool:
        return (await r.status()).parked == 1

    await until(parked)
    await publisher.wait_for(1)
    assert [e.id for e in publisher.events] == [after.id]
    [record] = await r.parked()
    assert (record["_id"], record["collection"]) == (poison.id, "orders")
    assert "cannot encode" in record["last_error"] and (await r.status()).pending == 0
    broken = False
    assert await r.requeue([poison.id]) == 1
    await publisher.wait_for(2)
    await stopped(r, task)
    assert [e.id for e in publisher.events] == [after.id, poison.id]
    assert (await db.orders.find_one({"_id": 1}))["_outbox"] == []


async def test_real_change_stream_publishes_committed_not_aborted() -> None:
    mongoeco = pytest.importorskip("mongoeco", reason="mongoeco needs Python >= 3.13")
    from mongoeco.wire import AsyncMongoEcoProxyServer
    from pymongo import AsyncMongoClient

    eco = mongoeco.AsyncMongoClient()
    async with AsyncMongoEcoProxyServer(client=eco) as server:
        client: Any = AsyncMongoClient(
            f"mongodb://127.0.0.1:{server.address.port}/?directConnection=true", tz_aware=True
        )
        db = client.shop
        outbox = Outbox(db)
        await outbox.ensure_indexes()
        publisher = MemoryPublisher()
        r = relay(outbox, publisher, MongoEcoSource(eco.shop.outbox), max_wait=0.02)
        task = await running(r)

        async def active() -> bool:
            return (await r.status()).active

        await until(active)
        committed = await outbox.save_with_events(
            None, db.orders, {"_id": 1}, [Event(type="placed"), Event(type="paid")]
        )
        async with client.start_session() as session:
            with pytest.raises(RuntimeError):
                async with await session.start_transaction():
                    await outbox.save_with_events(session, db.orders, {"_id": 2}, [Event(type="x")])
                    raise RuntimeError("abort on purpose")
        await publisher.wait_for(2)

        # They may go out with the opening sweep, before the stream reaches them.
        await until(lambda: _checkpointed(db))
        await asyncio.sleep(0.2)  # the aborted save's change, if the stream showed it, by now
        await stopped(r, task)
        assert [e.id for e in publisher.events] == [e.id for e in committed.events]
        token = (await db.outbox_relays.find_one({"_id": "orders-relay"}))["token"]
        # The checkpoint is a real resume token: the stream resumes after it, with nothing new.
        stream = await MongoEcoSource(eco.shop.outbox).open(resume_after=token)
        assert (await stream.next_batch(10, 0.05)).changes == []
        await stream.aclose()
        await client.close()


async def test_quiet_stream_keeps_its_position_fresh(db: Any, outbox: Outbox) -> None:
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    source = ScriptedSource()
    r = relay(outbox, MemoryPublisher(), source)
    task = await running(r)
    # No outbox inserts, but the server's post-batch token moved past other writes.
    source.play(ChangeBatch([], {"_data": "pb1"}))

    async def moved() -> bool:
        return (await checkpoint(db)).get("token") == {"_data": "pb1"}

    await until(moved)
    await stopped(r, task)


async def test_order_per_aggregate_holds_across_a_failure_and_a_recovery(
    db: Any, outbox: Outbox
) -> None:
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    saved = await outbox.save_with_events(
        None, db.orders, {"_id": 1}, [Event(type="placed"), Event(type="paid"), Event(type="sent")]
    )
    other = await save(outbox, db, 1, start=2)
    first = saved.events[0].id
    failures = iter([True, True])  # the aggregate's first event fails twice
    publisher = MemoryPublisher(
        fail=lambda e: (
            ConnectionError("broker away") if e.id == first and next(failures, False) else None
        )
    )
    entries = list(await db.outbox.find({"aggregate_id": 1}).sort("sequence", 1).to_list(None))
    source = ScriptedSource()
    r = relay(outbox, publisher, source, sweep_interval=0.05)
    task = await running(r)
    # The stream delivers the aggregate's last events first, then loses its history.
    source.play(
        inserts(entries[1:] + other, "t1"),
        inserts(entries[:1], "t2"),
        OperationFailure("history lost", code=286),
    )
    await publisher.wait_for(4)
    await stopped(r, task)
    mine = [e.id for e in publisher.events if e.aggregate_id == 1]
    assert mine == [e.id for e in saved.events]
    assert r.recoveries == 1 and (await r.status()).publish_failures == 2


async def test_a_deposed_leader_cannot_move_the_checkpoint(db: Any) -> None:
    from datetime import timedelta

    from mongo_outbox._relay.lease import FencedLease, LeaseLost

    old = FencedLease(db.outbox_relays, "orders-relay", timedelta(seconds=0.2))
    new = FencedLease(db.outbox_relays, "orders-relay", timedelta(seconds=30))
    assert await old.acquire()
    assert not await new.acquire()  # the lease is live
    await asyncio.sleep(0.3)  # the old leader stalls past its lease
    assert await new.acquire()
    assert (new.fence or 0) > (old.fence or 0)
    with pytest.raises(LeaseLost):
        await old.save({"_data": "stale"})
    await new.save({"_data": "fresh"})
    assert not await old.acquire()
    doc = await db.outbox_relays.find_one({"_id": "orders-relay"})
    assert doc["token"] == {"_data": "fresh"} and doc["owner"] == new.owner


@pytest.fixture
async def eco() -> Any:
    """mongoeco's in-process client (it serves change streams) behind its own wire server, and a
    real PyMongo client writing through that server."""
    mongoeco = pytest.importorskip("mongoeco", reason="mongoeco needs Python >= 3.13")
    from mongoeco.wire import AsyncMongoEcoProxyServer
    from pymongo import AsyncMongoClient

    server_side = mongoeco.AsyncMongoClient()
    async with AsyncMongoEcoProxyServer(client=server_side) as server:
        client: Any = AsyncMongoClient(
            f"mongodb://127.0.0.1:{server.address.port}/?directConnection=true", tz_aware=True
        )
        yield server_side, client
        await client.close()


async def test_history_lost_on_a_real_stream_recovers_by_sweeping(
    eco: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server_side, client = eco
    db = client.shop
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    publisher = MemoryPublisher()
    source = MongoEcoSource(server_side.shop.outbox)
    first = relay(outbox, publisher, source, max_wait=0.02)
    task = await running(first)
    await until(lambda: _active(first))
    before = await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
    await publisher.wait_for(1)

    # It may go out with the opening sweep, before the stream reaches its change: the token is
    # saved once the stream has.
    await until(lambda: _checkpointed(db))
    await stopped(first, task)
    token = (await db.outbox_relays.find_one({"_id": "orders-relay"}))["token"]
    source.forget_history()  # the oplog rolls over while the relay is down
    missed = await outbox.save_with_events(None, db.orders, {"_id": 2}, [Event(type="placed")])

    second = relay(outbox, publisher, source, max_wait=0.02)
    with caplog.at_level("WARNING", logger="mongo_outbox.changestream"):
        task = await running(second)
        await publisher.wait_for(2)  # the recovery's sweep found it
        await until(lambda: _active(second))
    assert second.recoveries == 1
    assert any(
        "recovering" in r.message and "no longer available" in r.message for r in caplog.records
    )
    after = await outbox.save_with_events(None, db.orders, {"_id": 3}, [Event(type="placed")])
    await publisher.wait_for(3)  # and the stream watched from the captured time

    async def moved() -> bool:
        doc = await db.outbox_relays.find_one({"_id": "orders-relay"})
        return bool(doc.get("token")) and doc["token"] != token

    await until(moved)
    await stopped(second, task)
    assert [e.id for e in publisher.events] == [s.events[0].id for s in (before, missed, after)]
    source.close()


async def test_embedded_mode_on_a_real_stream(eco: Any) -> None:
    from mongo_outbox.changestream import WatchSource

    server_side, client = eco
    db = client.shop
    outbox = Outbox(db, mode="embedded", collections=["orders", "carts"])
    await outbox.ensure_indexes()
    pipeline = WatchSource.for_outbox(outbox).pipeline
    source = MongoEcoSource(server_side.shop, pipeline, full_document="updateLookup")
    publisher = MemoryPublisher()
    r = relay(outbox, publisher, source, max_wait=0.02)
    task = await running(r)
    await until(lambda: _active(r))
    saves = [
        await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")]),
        await outbox.save_with_events(None, db.carts, {"_id": "c"}, [Event(type="filled")]),
        await outbox.save_with_events(
            None, db.orders, {"_id": 1}, [Event(type="paid"), Event(type="sent")]
        ),
    ]
    async with client.start_session() as session:
        with pytest.raises(RuntimeError):
            async with await session.start_transaction():
                await outbox.save_with_events(session, db.orders, {"_id": 2}, [Event(type="x")])
                raise RuntimeError("abort on purpose")
    await db.orders.update_one({"_id": 1}, {"$set": {"note": "no events"}})
    await publisher.wait_for(4)
    await asyncio.sleep(0.2)  # room for a wrong extra publication to show up
    await stopped(r, task)
    expected = [e.id for s in saves for e in s.events]
    assert sorted(e.id for e in publisher.events) == sorted(expected)
    assert [e.type for e in publisher.events if e.aggregate_id == 1] == ["placed", "paid", "sent"]
    assert await db.orders.find_one({"_id": 2}) is None
    assert (await db.orders.find_one({"_id": 1}))["_outbox"] == []
    status = await r.status()
    assert status.pending == 0 and status.last_checkpoint_at is not None
    source.close()


async def test_broker_outage_on_a_real_stream_and_real_nats(
    eco: Any, nats_client: Any, unique: str
) -> None:
    """JetStream refuses every message until the stream exists (as when the broker is down):
    entries back off, their aggregates wait, and once it is back everything arrives once, in
    order per aggregate."""
    server_side, client = eco
    db = client.shop
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    source = MongoEcoSource(server_side.shop.outbox)
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{unique}.{{type}}", timeout=1.0)
    # Saved before the relay starts: on the emulator a save beside the relay's writes may
    # conflict (docs/testing.md); the relay's first sweep finds them.
    saved = [
        await outbox.save_with_events(
            None, db.orders, {"_id": n % 2}, [Event(type="placed"), Event(type="paid")]
        )
        for n in range(4)
    ]
    r = relay(outbox, publisher, source, max_wait=0.02, max_attempts=1000, sweep_interval=0.2)
    task = await running(r)
    await until(lambda: _active(r))

    async def failing() -> bool:
        return (await r.status()).publish_failures >= 3

    await until(failing)
    js = nats_client.jetstream()
    await js.add_stream(name=unique, subjects=[f"{unique}.>"])
    try:

        async def all_published() -> bool:
            return (await r.status()).pending == 0

        await until(all_published, timeout=20)
        await stopped(r, task)
        assert (await js.stream_info(unique)).state.messages == 8
        sub = await js.subscribe(f"{unique}.>", ordered_consumer=True)
        received = [Event.from_json((await sub.next_msg(timeout=5)).data) for _ in range(8)]
        await sub.unsubscribe()
    finally:
        await js.delete_stream(unique)
        await publisher.aclose()
        source.close()
    for order in (0, 1):
        expected = [e.id for s in saved for e in s.events if e.aggregate_id == order]
        assert [e.id for e in received if e.aggregate_id == order] == expected


class KillSwitch:
    """Publishes into ``inner``; right after the ``after``-th confirm it cancels ``task``: the
    process dies between the broker's confirm and the relay's next write."""

    def __init__(self, inner: MemoryPublisher, after: int) -> None:
        self.inner = inner
        self.after = after
        self.confirmed = 0
        self.fired = 0
        self.task: asyncio.Task[None] | None = None

    async def publish(self, event: Event) -> None:
        await self.inner.publish(event)
        self.confirmed += 1
        if self.confirmed == self.after and self.task is not None:
            self.fired = 1
            self.task.cancel()

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_relays_cancelled_at_random_points_lose_nothing(eco: Any, mode: str) -> None:
    """In-process companion of the SIGKILL test below, with finer-grained kill points: rounds of
    committed and aborted saves, each followed by a relay cancelled at a random point (mid-batch,
    after a confirm and before settling or checkpointing, mid-sweep...), then a last relay. Every
    committed event is published at least once, no aborted one, and first publications keep
    sequence order per aggregate. (Saves run while no relay writes: the emulator's transactions
    conflict per collection, see docs/testing.md.)"""
    from mongo_outbox.changestream import WatchSource

    server_side, client = eco
    db = client.shop
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    if mode == "collection":
        source = MongoEcoSource(server_side.shop.outbox)
    else:
        pipeline = WatchSource.for_outbox(outbox).pipeline
        source = MongoEcoSource(server_side.shop, pipeline, full_document="updateLookup")
    publisher = MemoryPublisher()
    chance = random.Random(7)
    committed: list[str] = []
    aborted: list[str] = []
    # Leases of seconds for every relay: the emulator runs on this test's loop, which stalls for
    # up to 2 s on a loaded machine. A 0.3 s lease was lost in every stall, so a crashing relay
    # could go 10 s without being active once (CI under stress-ng); a 0.5 s claim left less than
    # the time a loaded claim of the backlog took before a publish had to start, so every round
    # released its claim unpublished (the relay warns of it: test_relay.py). A crashed relay's
    # lease is taken over once it runs out (the cancelled relay releases it when it can).
    options: dict[str, Any] = {"max_wait": 0.01, "leader_lease": 3.0, "claim_lease": 3.0}
    options |= {"publish_timeout": 0.2, "sweep_interval": 0.3, "batch_size": 7}
    kills_after_confirm = 0
    # A first relay gets a checkpoint, so that the crashing ones resume the stream.
    first = relay(outbox, publisher, source, **options)
    task = await running(first)
    await until(lambda: _active(first))
    saved = await outbox.save_with_events(None, db.orders, {"_id": 0}, [Event(type="step")])
    committed += [e.id for e in saved.events]
    await until(lambda: _has_token(db))
    await stopped(first, task)
    for kill in range(8):
        for _ in range(25):
            order = chance.randrange(6)
            if chance.random() < 0.1:
                aborted.append(await save_aborted(outbox, db, order))
                continue
            saved = await outbox.save_with_events(
                None, db.orders, {"_id": order}, [Event(type="step")]
            )
            committed += [e.id for e in saved.events]
        switch = KillSwitch(publisher, after=chance.randint(1, 12))
        crashing = relay(outbox, switch, source, **options)
        task = switch.task = await running(crashing)
        # Active once the last one's lease ran out (or already dead after a confirm).
        await until(functools.partial(_active_or_done, crashing, task))
        if kill % 2:
            # It dies right after a confirm, before settling: waited for, as long as it
            # publishes (a fixed wait passed no confirm at all in some loaded runs).
            waited = asyncio.wait({task})
            await progressing(waited, lambda: len(publisher.events), stalled=30)
        else:
            # At a random time, or after a confirm if that comes first.
            await asyncio.wait({task}, timeout=chance.uniform(0.0, 0.3))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        kills_after_confirm += switch.fired
    last = relay(outbox, publisher, source, **options)
    task = await running(last)
    stalls = LoopStalls()

    async def pending() -> int:
        return (await last.status()).pending

    async def explain() -> str:
        status = await last.status()
        # The emulator serves on this loop: where its own tasks wait tells a hung server.
        serving = [awaiting(t) for t in asyncio.all_tasks() if "mongoeco" in awaiting(t)]
        return (
            f"{status!r}; the loop's longest stall: {stalls.longest:.2f} s; the relay waits in\n"
            f"{awaiting(task)}\nthe emulator's tasks:\n" + "\n--\n".join(serving)
        )

    with stalls.watching():
        await drained(pending, explain=explain)
    await stopped(last, task)
    source.close()
    ids = [e.id for e in publisher.events]
    assert set(ids) == set(committed) and not set(ids) & set(aborted)
    seen: set[str] = set()
    sequences: dict[Any, list[int]] = {}
    for event in publisher.events:
        if event.id not in seen:
            seen.add(event.id)
            sequences.setdefault(event.aggregate_id, []).append(event.sequence or 0)
    assert all(s == list(range(1, len(s) + 1)) for s in sequences.values()), sequences
    # Nothing is marked published that the broker did not confirm, nor left behind.
    if mode == "collection":
        marked = await db.outbox.distinct("_id", {"status": "published"})
        assert set(marked) == set(committed)
    else:
        assert all(d["_outbox"] == [] for d in await db.orders.find().to_list(None))
    # The rounds did crash between a confirm and the relay's next write, and that republished.
    assert kills_after_confirm > 0 and len(ids) > len(set(ids))


async def _active(r: ChangeStreamRelay) -> bool:
    return (await r.status()).active


async def _checkpointed(db: Any) -> bool:
    doc = await db.outbox_relays.find_one({"_id": "orders-relay"})
    return bool(doc and doc.get("token"))


async def _active_or_done(r: ChangeStreamRelay, task: asyncio.Task[None]) -> bool:
    return task.done() or await _active(r)


async def test_a_steady_trickle_of_changes_still_closes_batches_at_max_wait(db: Any) -> None:
    """A change every few milliseconds never leaves a getMore empty-handed: the batch must close
    at max_wait all the same, not wait for max_size changes."""
    from mongo_outbox.changestream import WatchSource

    stream = await WatchSource(db.trickle, max_await_ms=200).open(
        start_at=await WatchSource(db.trickle).cluster_time()
    )
    writing = True

    async def trickle() -> None:
        n = 0
        while writing:
            n += 1
            await db.trickle.insert_one({"_id": n})
            await asyncio.sleep(0.005)

    writer = asyncio.create_task(trickle())
    try:
        # Without the deadline between changes this waits for 10,000 changes: minutes.
        batch = await asyncio.wait_for(stream.next_batch(max_size=10_000, max_wait=0.05), 10)
    finally:
        writing = False
        await writer
        await stream.aclose()
    assert 1 <= len(batch.changes) < 100 and batch.token is not None


async def test_watch_source_follows_a_server_stream(db: Any, outbox: Outbox) -> None:
    """PyMongo's own watch() against the test server (a replica set, or the emulator)."""
    publisher = MemoryPublisher()
    r = ChangeStreamRelay(
        outbox, publisher, name="orders-relay", settings=RelaySettings(backoff=FAST)
    )
    task = await running(r)

    async def watching() -> bool:
        return (await checkpoint(db)).get("fence") is not None

    await until(watching)
    await asyncio.sleep(0.5)  # past the recovery sweep: what follows comes from the stream
    saved = await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
    await publisher.wait_for(1)
    await until(lambda: _has_token(db))
    await stopped(r, task)
    assert [e.id for e in publisher.events] == [e.id for e in saved.events]


async def _has_token(db: Any) -> bool:
    return (await checkpoint(db)).get("token") is not None


async def test_stop_hands_the_lease_over_at_once(db: Any, outbox: Outbox) -> None:
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    # A lease far longer than the test's timeout: only stop()'s release lets the standby in.
    leader = relay(outbox, MemoryPublisher(), ScriptedSource(), leader_lease=60.0)
    standby = relay(outbox, MemoryPublisher(), ScriptedSource(), leader_lease=0.4)
    leader_task = await running(leader)
    await until(lambda: _active(leader))
    standby_task = await running(standby)
    await stopped(leader, leader_task)
    assert leader.state == "stopped"
    await until(lambda: _active(standby), timeout=5)
    assert standby.state == "active"
    await stopped(standby, standby_task)


async def test_embedded_mode_follows_a_server_stream(db: Any) -> None:
    """PyMongo's watch() of the database, with post-images looked up."""
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    await outbox.ensure_indexes()
    publisher = MemoryPublisher()
    r = ChangeStreamRelay(
        outbox, publisher, name="orders-relay", settings=RelaySettings(backoff=FAST)
    )
    task = await running(r)
    await until(lambda: _has_token(db))
    saved = await outbox.save_with_events(
        None, db.orders, {"_id": 1}, [Event(type="placed"), Event(type="paid")]
    )
    await publisher.wait_for(2)
    await stopped(r, task)
    assert [e.id for e in publisher.events] == [e.id for e in saved.events]
    assert (await db.orders.find_one({"_id": 1}))["_outbox"] == []


async def test_dropped_outbox_collection_recovers(db: Any, outbox: Outbox) -> None:
    """A drop event from the server: the watched collection is dropped and created again."""
    publisher = MemoryPublisher()
    r = ChangeStreamRelay(
        outbox, publisher, name="orders-relay", settings=RelaySettings(backoff=FAST)
    )
    task = await running(r)
    await until(lambda: _has_token(db))
    await db.outbox.drop()
    await outbox.ensure_indexes()

    async def recovered() -> bool:
        return r.recoveries == 1  # the drop (its first start is none)

    await until(recovered)
    await asyncio.sleep(0.5)  # watching again from the captured time
    saved = await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
    await publisher.wait_for(1)
    await stopped(r, task)
    assert [e.id for e in publisher.events] == [e.id for e in saved.events]


@pytest.mark.timeout(270)
@pytest.mark.parametrize("mode", ["collection", "embedded"])
@pytest.mark.crash
async def test_relay_processes_killed_at_random_lose_nothing(
    mongo: Any, db: Any, nats_client: Any, nats_stream: str, mode: str
) -> None:
    """Two relay processes of one name, each SIGKILLed at a random point and restarted, while
    a writer commits (and sometimes aborts) events: every committed event reaches JetStream at
    least once (deduplicated there by event id), none of the aborted, in sequence order per
    aggregate."""
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    # Writes, one event each; 1 in 10 aborted. Half as many on the emulator, whose round trips
    # cost several times a server's (CI runs this on two Pythons); the relays are killed as often.
    total = 1000 if mongo.kind == "emulator" else 2000
    committed: list[str] = []
    aborted: list[str] = []
    writing = True
    rounds = 0

    async def write() -> None:
        nonlocal writing
        chance = random.Random(1)
        n = -1
        # At least `total` writes, and on until two rounds of kills are over (a fast writer
        # would otherwise finish under the first pair of relays).
        while n + 1 < total or rounds < 3:
            n += 1
            order = chance.randrange(50)
            if n % 10 == 9:
                aborted.append(await save_aborted(outbox, db, order))
                continue
            event = Event(type="step")
            await outbox.save_with_events(None, db.orders, {"_id": order}, [event])
            committed.append(event.id)
        writing = False

    async def relay_process(seed: int) -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.crash.changestream_process",
            mongo.uri,
            db.name,
            mode,
            nats_stream,
            "orders-relay",
            str(seed),
            cwd=ROOT,
        )
        assert await asyncio.wait_for(process.wait(), 60) == -9  # only ever killed

    async def keep_two_relays_dying() -> None:
        nonlocal rounds
        while writing:
            rounds += 1
            await asyncio.gather(relay_process(2 * rounds), relay_process(2 * rounds + 1))

    async def write_once_watched() -> None:
        # The writer starts once a relay follows the stream: its successors resume from the
        # checkpointed token (the restart path under test), not from a recovery sweep.
        await until(lambda: _has_token(db), timeout=30)
        first_token.append((await checkpoint(db))["token"])
        await write()

    first_token: list[Any] = []
    # However slow the machine, saves and relay rounds go on; a stall fails (past the first
    # relay's 30 s to follow the stream), not a fixed deadline (172 s of 180 at load 8).
    await progressing(
        asyncio.gather(write_once_watched(), keep_two_relays_dying()),
        lambda: len(committed) + len(aborted) + rounds,
        stalled=45,
    )
    js = nats_client.jetstream()
    # The killed relays did relay while the writer wrote, and moved the checkpoint on.
    assert rounds >= 2 and (await js.stream_info(nats_stream)).state.messages > 0
    assert (await checkpoint(db))["token"] != first_token[0]
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    # Sweeping often: entries the killed relays claimed are due again after their claim lease.
    last = ChangeStreamRelay(outbox, publisher, name="orders-relay", sweep_interval=1.0)
    task = await running(last)

    async def pending() -> int:
        return (await last.status()).pending

    async def explain() -> str:
        return f"{await last.status()!r}"

    await drained(pending, explain=explain)
    await stopped(last, task)
    await publisher.aclose()
    count = (await js.stream_info(nats_stream)).state.messages
    sub = await js.subscribe(f"{nats_stream}.>", ordered_consumer=True)
    received = [Event.from_json((await sub.next_msg(timeout=5)).data) for _ in range(count)]
    await sub.unsubscribe()
    ids = {e.id for e in received}
    # What went out first, then that the stream's duplicate window held each id once.
    assert not ids & set(aborted)
    assert ids == set(committed)
    assert count == len(committed)
    sequences: dict[Any, list[int]] = {}
    for event in received:
        sequences.setdefault(event.aggregate_id, []).append(event.sequence or 0)
    assert all(s == sorted(s) for s in sequences.values())
