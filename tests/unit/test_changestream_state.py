"""The change-stream relay's decisions that need no server: which errors resume, which recover
and which stop it; which aggregate writes ring the bell in embedded mode; how a driver stream is
cut into batches."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import (
    AutoReconnect,
    ConfigurationError,
    CursorNotFound,
    NetworkTimeout,
    NotPrimaryError,
    OperationFailure,
)

from mongo_outbox import Outbox
from mongo_outbox._relay.store.embedded import EmbeddedStore
from mongo_outbox.changestream import WatchSource, triage
from mongo_outbox.changestream.source import database_of


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (OperationFailure("history lost", code=286), "recover"),
        (OperationFailure("invalid resume token", code=260), "recover"),
        (OperationFailure("resume token was not found", code=280), "recover"),
        (
            OperationFailure(
                "interrupted", code=11601, details={"errorLabels": ["ResumableChangeStreamError"]}
            ),
            "resume",
        ),
        (OperationFailure("not primary (pre-4.4 server, no label)", code=10107), "resume"),
        (OperationFailure("interrupted by killOp, no label", code=11601), "resume"),
        (
            OperationFailure(
                "write conflict", code=112, details={"errorLabels": ["TransientTransactionError"]}
            ),
            "resume",
        ),
        (
            OperationFailure(
                "labelled for a retry", code=9, details={"errorLabels": ["RetryableWriteError"]}
            ),
            "resume",
        ),
        (CursorNotFound("cursor id not found", code=43), "resume"),
        (AutoReconnect("connection reset"), "resume"),
        (NetworkTimeout("timed out"), "resume"),
        (NotPrimaryError("not writable primary"), "resume"),
        (OperationFailure("not authorized on shop to execute changeStream", code=13), "fatal"),
        (OperationFailure("$changeStream only supported on replica sets", code=40573), "fatal"),
        (ConfigurationError("bad option"), "fatal"),
        (ValueError("not a driver error"), "fatal"),
    ],
)
def test_triage(error: BaseException, expected: str) -> None:
    assert triage(error) == expected


ENTRY = {"id": "e1", "type": "placed"}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # With a post-image: entries left and nobody holding the document.
        ({"operationType": "insert", "fullDocument": {"_outbox": [ENTRY]}}, True),
        ({"operationType": "update", "fullDocument": {"_outbox": [ENTRY]}}, True),
        ({"operationType": "update", "fullDocument": {"_outbox": []}}, False),
        ({"operationType": "replace", "fullDocument": {"name": "no events"}}, False),
        # Parked entries wait for an operator, not for the relay.
        (
            {"operationType": "update", "fullDocument": {"_outbox": [ENTRY | {"parked": True}]}},
            False,
        ),
        (
            {"operationType": "update", "fullDocument": {"_outbox": [ENTRY | {"parked": False}]}},
            True,
        ),
        # A relay's own claim: its settle writes again if anything is left.
        (
            {"operationType": "update", "fullDocument": {"_outbox": [ENTRY], "_outbox_claim": "c"}},
            False,
        ),
        # Without one (the document is gone, or no lookup): the update's own fields tell.
        (
            {
                "operationType": "update",
                "updateDescription": {"updatedFields": {"_outbox.3": ENTRY, "_version": 4}},
            },
            True,
        ),
        (
            {
                "operationType": "update",
                "updateDescription": {"updatedFields": {"_outbox_due": 1, "name": "x"}},
            },
            False,
        ),
        ({"operationType": "insert"}, True),
    ],
)
def test_which_aggregate_writes_ring_the_bell(change: dict[str, Any], expected: bool) -> None:
    db = AsyncMongoClient[Any](connect=False).shop
    store = EmbeddedStore(Outbox(db, mode="embedded", collections=["orders"]))
    located = {"ns": {"db": "shop", "coll": "orders"}, "documentKey": {"_id": 1}} | change
    assert store.may_have_work(located) is expected
    # Writes to a collection the outbox does not scan never do.
    assert store.may_have_work(located | {"ns": {"db": "shop", "coll": "users"}}) is False


class FakeDriverStream:
    """FAKE of PyMongo's AsyncChangeStream: ``try_next`` hands out ``changes`` one by one and
    then None (an idle getMore); ``resume_token`` follows the last change handed out, then
    becomes the post-batch token, as the driver's does."""

    def __init__(self, changes: list[dict[str, Any]]) -> None:
        self.changes = list(changes)
        self.resume_token: Any = None
        self.closed = False
        self.alive = True

    async def try_next(self) -> dict[str, Any] | None:
        if not self.changes:
            self.resume_token = {"_data": "post-batch"}
            return None
        change = self.changes.pop(0)
        self.resume_token = change["_id"]
        return change

    async def close(self) -> None:
        self.closed = True


class FakeWatchable:
    def __init__(self, stream: FakeDriverStream) -> None:
        self.stream = stream
        self.calls: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []

    async def watch(self, pipeline: list[dict[str, Any]], **options: Any) -> FakeDriverStream:
        self.calls.append((pipeline, options))
        return self.stream


def change(n: int, kind: str = "insert") -> dict[str, Any]:
    return {"_id": {"_data": f"t{n}"}, "operationType": kind}


async def test_watch_source_cuts_batches_by_size_and_at_stream_ends() -> None:
    driver = FakeDriverStream([change(1), change(2), change(3), change(4, "invalidate"), change(5)])
    target = FakeWatchable(driver)
    stream = await WatchSource(target, [{"$match": {}}]).open(resume_after={"_data": "t0"})
    assert target.calls == [
        ([{"$match": {}}], {"max_await_time_ms": 100, "resume_after": {"_data": "t0"}})
    ]
    first = await stream.next_batch(2, 1.0)
    assert [c["_id"] for c in first.changes] == [{"_data": "t1"}, {"_data": "t2"}]
    assert first.token == {"_data": "t2"}  # mid-batch: the last change's token
    second = await stream.next_batch(10, 1.0)
    assert [c["operationType"] for c in second.changes] == ["insert", "invalidate"]
    third = await stream.next_batch(10, 1.0)
    assert third.changes == [change(5)]
    idle = await stream.next_batch(10, 0.01)
    assert idle == ([], {"_data": "post-batch"})  # a quiet stream still moves its token
    await stream.aclose()
    assert driver.closed


async def test_watch_source_starts_at_a_cluster_time_with_post_images() -> None:
    target = FakeWatchable(FakeDriverStream([]))
    await WatchSource(target, full_document="updateLookup", max_await_ms=20).open(start_at=42)
    assert target.calls == [
        (
            [],
            {
                "max_await_time_ms": 20,
                "start_at_operation_time": 42,
                "full_document": "updateLookup",
            },
        )
    ]


async def test_a_stream_the_server_ended_reads_as_an_invalidate() -> None:
    driver = FakeDriverStream([change(1)])
    stream = await WatchSource(FakeWatchable(driver)).open()
    assert [c["_id"] for c in (await stream.next_batch(10, 0.01)).changes] == [{"_data": "t1"}]
    driver.alive = False  # closed by the server, e.g. after an invalidate a filter dropped
    batch = await stream.next_batch(10, 1.0)
    assert [c["operationType"] for c in batch.changes] == ["invalidate"]


async def test_cluster_time_is_asked_of_the_database_of_a_collection_or_of_itself() -> None:
    # A database answers any attribute with a collection, ``db.database`` included.
    client: Any = AsyncMongoClient("mongodb://127.0.0.1:1", connect=False)
    assert database_of(client.shop) == client.shop
    assert database_of(client.shop.outbox) == client.shop
    await client.close()
