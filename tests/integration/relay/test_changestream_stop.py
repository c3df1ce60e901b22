"""A change-stream relay's stop and cancellation: its stream's read never outlives it, nor
runs beside the stream's close; a stop in an outage is prompt; what a forced stop leaves is
said right."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from pymongo import AsyncMongoClient
from pymongo.errors import AutoReconnect

from mongo_outbox import ChangeStreamRelay, Outbox
from mongo_outbox.changestream.source import ChangeBatch
from mongo_outbox.publishers import MemoryPublisher
from tests.integration.cli.test_cli_stop import MongoGate
from tests.support.servers import MongoServer
from tests.support.waiting import until


class _SlowStream:
    """A getMore that waits for a server, then fails (as PyMongo does during an outage)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.closed = False

    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        self.log.append("getMore")
        await asyncio.sleep(0.3)
        self.log.append(f"getMore ends, stream closed={self.closed}")
        raise AutoReconnect("no server answered")

    async def aclose(self) -> None:
        self.log.append("close")
        self.closed = True


class _Source:
    def __init__(self) -> None:
        self.log: list[str] = []

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> Any:
        return _SlowStream(self.log)

    async def cluster_time(self) -> Any:
        return "T1"


async def test_a_cancelled_relay_ends_its_stream_read_before_it_closes_the_stream(db: Any) -> None:
    # The read went on after run() ended, on a stream closed beneath it, and its error was
    # never retrieved ("Task exception was never retrieved").
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    loop.set_exception_handler(lambda _l, ctx: reported.append(ctx["message"]))
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await db.outbox_relays.insert_one({"_id": "r", "token": {"_data": "t0"}})
    source = _Source()
    relay = ChangeStreamRelay(outbox, MemoryPublisher(), name="r", source=source)
    task = asyncio.create_task(relay.run())
    await until(lambda: "getMore" in source.log)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0.5)
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert source.log == ["getMore", "close"], source.log  # the getMore ended with run()
    assert reported == []


async def test_a_stopped_relay_never_closes_a_motor_stream_beside_its_read(
    mongo: Any, monkeypatch: Any
) -> None:
    # Motor reads in a thread a cancel does not stop: the close ran beside it on one cursor.
    import threading
    import uuid

    from motor.motor_asyncio import AsyncIOMotorClient
    from pymongo.change_stream import ChangeStream as SyncStream

    calls: list[str] = []
    original_try = SyncStream.try_next
    original_close = SyncStream.close

    def try_next(self: Any) -> Any:
        calls.append(f"try_next start {threading.current_thread().name}")
        try:
            return original_try(self)
        except BaseException as error:
            calls.append(f"try_next failed {error!r:.80}")
            raise
        finally:
            calls.append("try_next end")

    def close(self: Any) -> None:
        calls.append(f"close start {threading.current_thread().name}")
        original_close(self)
        calls.append("close end")

    monkeypatch.setattr(SyncStream, "try_next", try_next)
    monkeypatch.setattr(SyncStream, "close", close)
    client = AsyncIOMotorClient(mongo.uri, tz_aware=True)
    db = client[f"t_{uuid.uuid4().hex[:12]}"]
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    relay = ChangeStreamRelay(outbox, MemoryPublisher(), name="r", max_wait=2.0)
    task = asyncio.create_task(relay.run())
    await until(lambda: relay.state == "active")
    await asyncio.sleep(0.55)
    relay.stop()
    await task
    await asyncio.sleep(0.5)
    await client.drop_database(db.name)
    client.close()
    tail = calls[-10:]
    # overlapping: a close started while a try_next had not ended
    depth, overlap = 0, False
    for c in calls:
        if c.startswith("try_next start"):
            depth += 1
        elif c == "try_next end":
            depth -= 1
        elif c.startswith("close start") and depth:
            overlap = True
    assert not overlap, tail


class _CountingSource:
    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> Any:
        self.opened += 1
        source = self

        class Stream:
            async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
                await asyncio.sleep(max_wait)
                return ChangeBatch([], None)

            async def aclose(self) -> None:
                source.closed += 1

        return Stream()

    async def cluster_time(self) -> Any:
        return "T1"


async def test_a_stream_is_closed_when_the_resumes_first_read_fails(db: Any) -> None:
    from mongo_outbox.settings import Backoff, RelaySettings

    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await db.outbox_relays.insert_one({"_id": "r", "token": {"_data": "t0"}})
    source = _CountingSource()
    relay = ChangeStreamRelay(
        outbox,
        MemoryPublisher(),
        name="r",
        source=source,
        settings=RelaySettings(backoff=Backoff(initial=0.01, maximum=0.01)),
    )
    store = relay._rounds.store
    real, failures = store.next_due, [AutoReconnect("blip"), AutoReconnect("blip")]

    async def next_due() -> Any:
        if failures:
            raise failures.pop()
        return await real()

    store.next_due = next_due  # type: ignore[method-assign]
    task = asyncio.create_task(relay.run())
    await until(lambda: source.opened >= 3)
    await asyncio.sleep(0.2)
    relay.stop()
    await task
    assert source.opened == source.closed


async def test_a_relay_cancelled_while_backing_off_says_its_lease_runs_out(
    db: Any, monkeypatch: Any
) -> None:
    from mongo_outbox.cli.relay import _left_behind
    from mongo_outbox.settings import Backoff
    from tests.support.changestream_sources import ScriptedSource

    monkeypatch.setattr(Backoff, "delay", lambda self, attempt: 30.0)
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await db.outbox_relays.insert_one({"_id": "r", "token": {"_data": "t0"}})
    source = ScriptedSource()
    relay = ChangeStreamRelay(outbox, MemoryPublisher(), name="r", source=source)
    task = asyncio.create_task(relay.run())
    await until(lambda: relay.state == "active")
    source.play(AutoReconnect("primary stepped down"))
    await until(lambda: relay.state == "standby")
    doc = await db.outbox_relays.find_one({"_id": "r"})
    assert doc["owner"] == relay.checkpoint.owner  # on standby, and still the lease's owner
    left = _left_behind(relay, relay.state)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert left == "its lease runs out, then a standby takes over"


async def test_a_stop_while_the_relay_renews_its_lease_in_an_outage_is_prompt(
    mongo: MongoServer, db: Any
) -> None:
    gate = MongoGate(mongo.uri)
    await gate.start()
    client: Any = AsyncMongoClient(gate.url + "&serverSelectionTimeoutMS=8000", tz_aware=True)
    outbox = Outbox(client[db.name])
    await outbox.ensure_indexes()
    relay = ChangeStreamRelay(outbox, MemoryPublisher(), name="r", leader_lease=60)
    task = asyncio.create_task(relay.run())
    await until(lambda: relay.state == "active", timeout=10)
    await asyncio.sleep(0.5)
    # Its renewal of the lease it still held, after the stream's error, waited for a server.
    await gate.close()  # MongoDB goes away (refused)
    await until(lambda: relay.state == "standby", timeout=30)
    await asyncio.sleep(1.0)  # the backoff is over: renewing the lease it still holds
    started = time.monotonic()
    relay.stop()
    await asyncio.wait_for(task, 30)
    took = time.monotonic() - started
    await client.close()
    assert took < 3
