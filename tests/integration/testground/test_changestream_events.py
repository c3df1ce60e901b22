"""Change events as MongoDB sends them, checked with plain PyMongo and no mongo-outbox code.

The relay reads what a server's change stream says: what an update changed, when a commit
happened and whose it was, which drops end a stream, where a stream started at a time begins,
and which streams the server refuses. Whatever MongoDB the suite runs on (a replica set with
``MONGODB_URI``, or the emulator) must say it as MongoDB's "Change Events" reference does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import pytest
from bson import Timestamp
from pymongo import AsyncMongoClient
from pymongo.errors import OperationFailure

INVALID_RESUME_TOKEN = 260
CHANGE_STREAM_FATAL = 280
UNRECOGNIZED_STAGE = 40324


async def next_change(stream: Any) -> dict[str, Any]:
    """The stream's next event, waiting for it as long as the stream's await time allows."""
    for _ in range(20):
        change = await stream.try_next()
        if change is not None:
            return dict(change)
    raise AssertionError("no change event came")


@pytest.fixture
async def stream_of(db: Any) -> AsyncIterator[Any]:
    streams: list[Any] = []

    async def open_stream(target: Any, *pipeline: Any, **options: Any) -> Any:
        stream = await target.watch(list(pipeline), max_await_time_ms=500, **options)
        streams.append(stream)
        return stream

    yield open_stream
    for stream in streams:
        await stream.close()


async def test_an_update_event_says_what_changed_removed_and_truncated(
    db: Any, stream_of: Any
) -> None:
    await db.c.insert_one({"_id": 1, "a": 1, "s": {"t": 1, "u": 2}, "x": 1, "b": [1, 2, 3]})
    stream = await stream_of(db.c)
    await db.c.update_one({"_id": 1}, {"$set": {"a": 2, "s.t": 5, "new": "n"}, "$unset": {"x": ""}})
    await db.c.update_one({"_id": 1}, {"$pop": {"b": 1}})
    await db.c.update_one({"_id": 1}, {"$push": {"b": 9}})
    first, popped, pushed = [await next_change(stream) for _ in range(3)]
    assert first["operationType"] == "update" and "fullDocument" not in first
    assert first["updateDescription"] == {
        "updatedFields": {"a": 2, "s.t": 5, "new": "n"},
        "removedFields": ["x"],
        "truncatedArrays": [],
    }
    assert popped["updateDescription"] == {
        "updatedFields": {},
        "removedFields": [],
        "truncatedArrays": [{"field": "b", "newSize": 2}],
    }
    assert pushed["updateDescription"]["updatedFields"] == {"b.2": 9}


async def test_events_carry_a_timestamp_and_a_wall_time_and_a_commit_is_one_time(
    client: AsyncMongoClient[Any], db: Any, stream_of: Any
) -> None:
    await db.c.insert_one({"_id": 0})  # the collection exists before the transaction
    stream = await stream_of(db)
    await db.c.insert_one({"_id": "plain"})
    async with client.start_session() as session:
        await session.start_transaction()
        await db.c.insert_one({"_id": "t-1"}, session=session)
        await db.d.insert_one({"_id": "t-2"}, session=session)
        await session.commit_transaction()
        lsid = session.session_id
    await db.c.insert_one({"_id": "after"})
    plain, t1, t2, after = [await next_change(stream) for _ in range(4)]
    for change in (plain, t1, t2, after):
        assert isinstance(change["clusterTime"], Timestamp)
        assert isinstance(change["wallTime"], datetime)
    assert "lsid" not in plain and "txnNumber" not in plain
    # One commit, one time; each event of it says whose transaction it was.
    assert t1["clusterTime"] == t2["clusterTime"]
    assert plain["clusterTime"] < t1["clusterTime"] < after["clusterTime"]
    for change in (t1, t2):
        assert change["lsid"]["id"] == lsid["id"]
        assert change["txnNumber"] == t1["txnNumber"] > 0
    assert [t1["documentKey"], t2["documentKey"]] == [{"_id": "t-1"}, {"_id": "t-2"}]


async def test_a_dropped_collection_ends_its_own_stream_and_not_its_databases(
    db: Any, stream_of: Any
) -> None:
    await db.gone.insert_one({"_id": 1})
    of_database = await stream_of(db)
    of_collection = await stream_of(db.gone)
    await db.gone.drop()
    await db.kept.insert_one({"_id": 2})
    dropped = await next_change(of_database)
    assert dropped["operationType"] == "drop"
    assert dropped["ns"] == {"db": db.name, "coll": "gone"}
    # The database's stream goes on: only dropDatabase invalidates it.
    assert (await next_change(of_database))["documentKey"] == {"_id": 2}
    assert (await next_change(of_collection))["operationType"] == "drop"
    invalidate = await next_change(of_collection)
    assert invalidate["operationType"] == "invalidate"
    assert not of_collection.alive
    # A stream cannot resume after an invalidate, only start after it.
    with pytest.raises(OperationFailure) as refused:
        await stream_of(db.gone, resume_after=invalidate["_id"])
    assert refused.value.code == INVALID_RESUME_TOKEN
    restarted = await stream_of(db.gone, start_after=invalidate["_id"])
    await db.gone.insert_one({"_id": 3})
    assert (await next_change(restarted))["documentKey"] == {"_id": 3}


async def test_a_stream_started_at_a_writes_operation_time_sees_that_write(
    client: AsyncMongoClient[Any], db: Any, stream_of: Any
) -> None:
    await db.c.insert_one({"_id": "before"})
    async with client.start_session() as session:
        await db.c.insert_one({"_id": "at"}, session=session)
        at = session.operation_time
    await db.c.insert_one({"_id": "later"})
    stream = await stream_of(db.c, start_at_operation_time=at)
    seen = [(await next_change(stream))["documentKey"]["_id"] for _ in range(2)]
    assert seen == ["at", "later"]


async def test_the_server_refuses_an_unknown_stage_and_a_pipeline_that_drops_the_token(
    db: Any, stream_of: Any
) -> None:
    with pytest.raises(OperationFailure) as unknown:
        await stream_of(db.c, {"$unsupported": 1})
    assert unknown.value.code == UNRECOGNIZED_STAGE
    stream = await stream_of(db.c, {"$project": {"_id": 0}})
    await db.c.insert_one({"_id": 1})
    with pytest.raises(OperationFailure) as fatal:
        await next_change(stream)
    assert fatal.value.code == CHANGE_STREAM_FATAL
    assert fatal.value.has_error_label("NonResumableChangeStreamError")


async def test_a_renamed_collection_ends_its_own_stream_and_says_where_it_went(
    client: AsyncMongoClient[Any], db: Any, stream_of: Any
) -> None:
    await db.before.insert_one({"_id": 1})
    of_database = await stream_of(db)
    of_collection = await stream_of(db.before)
    await db.before.rename("after")
    await db.after.insert_one({"_id": 2})
    renamed = await next_change(of_database)
    assert renamed["operationType"] == "rename"
    assert renamed["ns"] == {"db": db.name, "coll": "before"}
    assert renamed["to"] == {"db": db.name, "coll": "after"}
    assert (await next_change(of_database))["documentKey"] == {"_id": 2}
    assert (await next_change(of_collection))["operationType"] == "rename"
    assert (await next_change(of_collection))["operationType"] == "invalidate"
    assert not of_collection.alive


async def _open_cursor(db: Any, start: Timestamp) -> int:
    """A stream on ``db.c`` from ``start``, opened by hand: a getMore's batches are then the
    server's own, not the driver's buffer."""
    opened = await db.command(
        "aggregate",
        "c",
        pipeline=[{"$changeStream": {"startAtOperationTime": start}}],
        cursor={"batchSize": 0},
    )
    return int(opened["cursor"]["id"])


async def _get_more(db: Any, cursor_id: int, batch_size: int) -> list[dict[str, Any]]:
    reply = await db.command(
        "getMore", cursor_id, collection="c", batchSize=batch_size, maxTimeMS=5000
    )
    return list(reply["cursor"]["nextBatch"])


async def test_a_getmore_answers_with_what_was_there_while_writers_go_on(db: Any) -> None:
    """A getMore sends what the stream holds and returns: writers that go on while it works do
    not hold its answer until the batch is full (a relay would see nothing meanwhile)."""
    start = (await db.command("ping"))["operationTime"]
    await db.c.insert_many([{"_id": n} for n in range(300)])
    cursor_id = await _open_cursor(db, start)
    writing = True

    async def write(first: int) -> None:
        # Faster than a getMore sends (100 events a round trip), and within the 10,000 events
        # of history the emulator keeps (as an oplog, a replica set's is larger).
        for n in range(first, first + 1500, 100):
            if not writing:
                return
            await db.c.insert_many([{"_id": n + k} for k in range(100)])

    writers = [asyncio.ensure_future(write(1_000_000 * (w + 1))) for w in range(4)]
    try:
        await asyncio.sleep(0.05)  # the writers are under way
        batch = await _get_more(db, cursor_id, batch_size=5000)
    finally:
        writing = False
        await asyncio.gather(*writers)
    assert [c["documentKey"]["_id"] for c in batch[:300]] == list(range(300))
    assert len(batch) < 5000
    await db.command("killCursors", "c", cursors=[cursor_id])


async def test_other_commands_are_answered_while_a_getmore_works_through_a_backlog(
    db: Any,
) -> None:
    """A server serves its other connections while one getMore sends thousands of events: a
    relay's lease renewal must not wait behind another relay's catching up."""
    start = (await db.command("ping"))["operationTime"]
    await db.c.insert_many([{"_id": n, "pad": "x" * 200} for n in range(3000)])
    cursor_id = await _open_cursor(db, start)
    # Two connections open before: the update's answer must not wait on a handshake.
    await asyncio.gather(db.command("ping"), db.command("ping"))
    loop = asyncio.get_running_loop()
    took: dict[str, float] = {}

    async def catch_up() -> None:
        sent = loop.time()
        batch = await _get_more(db, cursor_id, batch_size=3000)
        took["getMore"] = loop.time() - sent
        assert len(batch) == 3000

    async def renew_meanwhile() -> None:
        await asyncio.sleep(0.02)  # after the getMore went out
        sent = loop.time()
        await db.lease.update_one({"_id": "l"}, {"$set": {"until": 1}}, upsert=True)
        took["update"] = loop.time() - sent

    await asyncio.gather(catch_up(), renew_meanwhile())
    # Answered in a fraction of the getMore's time, not after it (the emulator answered it
    # once the getMore was done: 0.98 of its time).
    assert took["update"] < took["getMore"] / 3, took
    await db.command("killCursors", "c", cursors=[cursor_id])


async def test_a_second_getmore_on_a_cursor_in_use_is_refused(db: Any) -> None:
    start = (await db.command("ping"))["operationTime"]
    await db.c.insert_many([{"_id": n, "pad": "x" * 200} for n in range(2000)])
    cursor_id = await _open_cursor(db, start)
    first = asyncio.ensure_future(_get_more(db, cursor_id, batch_size=2000))
    await asyncio.sleep(0.02)  # the first is under way
    second: Any = None
    try:
        await _get_more(db, cursor_id, batch_size=2000)
    except OperationFailure as error:
        second = error
    assert len(await first) == 2000
    # The second came while the first worked (CursorInUse, as on MongoDB), or after it ended
    # (nothing left to send): never half of the events each.
    if second is not None:
        assert second.code == 292, second.details
    await db.command("killCursors", "c", cursors=[cursor_id])
