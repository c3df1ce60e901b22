"""Change sources for tests: a scripted fake for the relay's state machine, and an adapter
over mongoeco's in-process client, which serves real change streams for writes made through
its wire server."""

from __future__ import annotations

import asyncio
from typing import Any

try:
    from mongoeco.errors import OperationFailure as EcoOperationFailure
except ImportError:  # mongoeco needs Python >= 3.13; the tests that use it skip without it

    class EcoOperationFailure(Exception):  # type: ignore[no-redef]
        pass


from pymongo.errors import OperationFailure

from mongo_outbox.changestream import ChangeBatch, ChangeStream
from mongo_outbox.testing._server_codes import server_error_code


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
    """Real change streams from mongoeco's in-process client, adapted to the relay's
    ChangeSource: its cursor has no ``resume_token`` (the last change's ``_id`` is the token),
    its ``close`` is not awaitable, its errors carry no codes (a lost or bad token becomes
    286 or 260 here, as a server would say), and its cluster time is the hub's next token.

    ``target`` is a mongoeco collection or database. mongoeco records changes only while
    someone watches, so the source holds a watcher open, as an oplog keeps history;
    ``forget_history()`` lets go of it, so writes until the next ``cluster_time()`` leave a gap
    that no resume token can cross, like an oplog that rolled over."""

    def __init__(
        self,
        target: Any,
        pipeline: list[dict[str, Any]] | None = None,
        *,
        full_document: str = "default",
    ) -> None:
        self.target = target
        # Asked on the class: a database's attribute lookup would answer with a collection.
        database = target if callable(getattr(type(target), "command", None)) else target.database
        self.client = database.client
        self.pipeline = pipeline or [{"$match": {"operationType": "insert"}}]
        self.full_document = full_document
        self.holder: Any = None
        self._hold()

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> ChangeStream:
        try:
            cursor = self.target.watch(
                self.pipeline,
                resume_after=resume_after,
                start_at_operation_time=start_at,
                full_document=self.full_document,
                max_await_time_ms=20,
            )
        except EcoOperationFailure as error:  # mongoeco's errors are not PyMongo's
            raise _as_server_error(error) from error
        return _MongoEcoStream(cursor)

    async def cluster_time(self) -> Any:
        self._hold()
        return self.client.change_stream_state()["nextToken"]

    def forget_history(self) -> None:
        if self.holder is not None:
            self.holder.close()
            self.holder = None

    close = forget_history

    def _hold(self) -> None:
        if self.holder is None:
            self.holder = self.target.watch([{"$match": {"_never": True}}])


def _as_server_error(error: Exception) -> Exception:
    code = server_error_code(error)
    if code is None:
        return error
    return OperationFailure(str(error), code=code, details={"code": code, "errmsg": str(error)})


class _MongoEcoStream:
    def __init__(self, cursor: Any) -> None:
        self.cursor = cursor

    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        # Its try_next answers at once when idle; wait like a server-side max_await would,
        # or a relay would spin and starve the writers of this very event loop.
        deadline = asyncio.get_running_loop().time() + max_wait
        changes: list[dict[str, Any]] = []
        while len(changes) < max_size:
            try:
                change = await self.cursor.try_next()
            except EcoOperationFailure as error:  # mongoeco's errors are not PyMongo's
                raise _as_server_error(error) from error
            if change is not None:
                changes.append(change)
            elif changes or asyncio.get_running_loop().time() >= deadline:
                break
            else:
                await asyncio.sleep(0.001)
        return ChangeBatch(changes, changes[-1]["_id"] if changes else None)

    async def aclose(self) -> None:
        self.cursor.close()
