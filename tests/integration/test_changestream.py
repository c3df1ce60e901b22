"""ChangeStreamRelay: checkpoints, recovery, leadership, parking, against the session's MongoDB
with a scripted change source, and against real change streams (mongoeco in process)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pymongo.errors import AutoReconnect, OperationFailure

from mongo_outbox import Backoff, ChangeStreamError, ChangeStreamRelay, Event, Outbox
from mongo_outbox.changestream import ChangeBatch
from mongo_outbox.publishers import MemoryPublisher
from tests.changestream_sources import MongoEcoSource, ScriptedSource, inserts

FAST = Backoff(initial=0.01, maximum=0.05)


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
    return ChangeStreamRelay(
        outbox,
        publisher,
        name="orders-relay",
        source=source,
        backoff=FAST,
        **({"lease": 30.0, "sweep_interval": 60.0} | options),
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


async def until(condition: Any, timeout: float = 10) -> None:
    async def poll() -> None:
        while not await condition():  # noqa: ASYNC110 - polling the database, no event to wait on
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout)


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
    assert (await checkpoint(db))["fence"] == 4  # taking the lease moved the fence on


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


async def test_fatal_error_stops_with_a_clear_error(db: Any, outbox: Outbox) -> None:
    source = ScriptedSource()
    source.play(OperationFailure("not authorized on db to execute changeStream", code=13))
    with pytest.raises(ChangeStreamError, match="not authorized"):
        await asyncio.wait_for(relay(outbox, MemoryPublisher(), source).run(), 10)


async def test_crash_after_publish_before_checkpoint_loses_nothing(db: Any, outbox: Outbox) -> None:
    await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
    first, second = await save(outbox, db, 2), await save(outbox, db, 2, start=2)
    source = ScriptedSource()
    crashing = MemoryPublisher()
    r1 = relay(outbox, crashing, source, lease=1.0, claim_lease=1.0, publish_timeout=0.5)
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
    leader = relay(outbox, MemoryPublisher(), leader_source, lease=0.5)
    standby_publisher = MemoryPublisher()
    standby = relay(outbox, standby_publisher, standby_source, lease=0.5)
    leader_task = await running(leader)

    async def leading() -> bool:
        return (await leader.status()).active

    await until(leading)
    standby_task = await running(standby)
    await asyncio.sleep(0.6)
    assert not (await standby.status()).active and standby_source.opens == []
    leader_task.cancel()  # the leader dies without a word
    with pytest.raises(asyncio.CancelledError):
        await leader_task

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


async def test_real_change_stream_publishes_committed_not_aborted() -> None:
    import mongoeco
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
        await asyncio.sleep(0.2)
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

    from mongo_outbox._checkpoint import Checkpoint, LeaseLost

    old = Checkpoint(db.outbox_relays, "orders-relay", timedelta(seconds=0.2))
    new = Checkpoint(db.outbox_relays, "orders-relay", timedelta(seconds=30))
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
    import mongoeco
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
    # Without a held watcher mongoeco keeps no history while nobody watches, like an oplog
    # that rolled over while the relay was down.
    source = MongoEcoSource(server_side.shop.outbox, hold_history=False)
    first = relay(outbox, publisher, source, max_wait=0.02)
    task = await running(first)
    await until(lambda: _active(first))
    before = await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
    await publisher.wait_for(1)
    await stopped(first, task)
    token = (await db.outbox_relays.find_one({"_id": "orders-relay"}))["token"]
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


async def _active(r: ChangeStreamRelay) -> bool:
    return (await r.status()).active
