"""Change sources for tests: a scripted fake for the relay's state machine, and an adapter
over mongoeco's in-process client, which serves real change streams for writes made through
its wire server."""

from __future__ import annotations

import asyncio
from typing import Any

from mongo_outbox.changestream import ChangeBatch, ChangeStream


class ScriptedSource:
    """FAKE change source: plays ``script`` (ChangeBatch or an exception to raise) to whichever
    stream is open, and records every ``open`` call and cluster time it handed out."""

    def __init__(self) -> None:
        self.script: asyncio.Queue[ChangeBatch | BaseException] = asyncio.Queue()
        self.open_errors: list[BaseException] = []
        self.opens: list[dict[str, Any]] = []
        self.cluster_times = 0

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> ChangeStream:
        self.opens.append({"resume_after": resume_after, "start_at": start_at})
        if self.open_errors:
            raise self.open_errors.pop(0)
        return _ScriptedStream(self.script)

    async def cluster_time(self) -> Any:
        self.cluster_times += 1
        return f"T{self.cluster_times}"

    def play(self, *items: ChangeBatch | BaseException) -> None:
        for item in items:
            self.script.put_nowait(item)


class _ScriptedStream:
    def __init__(self, script: asyncio.Queue[ChangeBatch | BaseException]) -> None:
        self.script = script

    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        try:
            item = await asyncio.wait_for(self.script.get(), max_wait)
        except asyncio.TimeoutError:
            return ChangeBatch([], None)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        pass


def inserts(entries: list[dict[str, Any]], token: str) -> ChangeBatch:
    """The batch a change stream would deliver for these inserted outbox documents."""
    changes = [
        {"operationType": "insert", "fullDocument": e, "documentKey": {"_id": e["_id"]}}
        for e in entries
    ]
    return ChangeBatch(changes, {"_data": token})


class MongoEcoSource:
    """Real change streams from mongoeco's in-process client. Its cursor has no
    ``resume_token`` (the last change's ``_id`` is the token) and a ``close`` that is not
    awaitable; it does not know cluster times, so recovery watches from "now"."""

    def __init__(self, collection: Any) -> None:
        self.collection = collection

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> ChangeStream:
        cursor = self.collection.watch(
            [{"$match": {"operationType": "insert"}}],
            resume_after=resume_after,
            max_await_time_ms=20,
        )
        return _MongoEcoStream(cursor)

    async def cluster_time(self) -> Any:
        return None


class _MongoEcoStream:
    def __init__(self, cursor: Any) -> None:
        self.cursor = cursor

    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        changes: list[dict[str, Any]] = []
        while len(changes) < max_size:
            change = await self.cursor.try_next()
            if change is None:
                break
            changes.append(change)
        return ChangeBatch(changes, changes[-1]["_id"] if changes else None)

    async def aclose(self) -> None:
        self.cursor.close()
