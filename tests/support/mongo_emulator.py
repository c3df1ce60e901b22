"""Serve mongoeco's MongoDB wire-protocol emulator on 127.0.0.1 until killed.

Usage: python tests/support/mongo_emulator.py PORT  (prints "ready PORT VERSION" once it listens)

mongoeco does not serve ``$changeStream`` over the wire, but its in-process client has real
change streams. ``ChangeStreamsOverWire`` (a test fixture, not part of the library) answers the
commands a driver's ``watch()`` sends (``aggregate`` with ``$changeStream``, ``getMore``,
``killCursors``) from those in-process streams, the way a replica set member would: cursor ids,
``postBatchResumeToken``, ``maxTimeMS`` as the await time, error codes 286/260/43, and an
``operationTime`` on every reply. So a ``pymongo.AsyncMongoClient`` in *another process* can
``watch()``, be SIGKILLed and resume, which is what the change-stream crash tests need.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bson import Timestamp
from mongoeco.errors import OperationFailure as EcoOperationFailure
from mongoeco.wire import AsyncMongoEcoProxyServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.changestream_sources import server_error_code

CURSOR_NOT_FOUND = 43
FIRST_ID = 1_000_001  # far above mongoeco's own cursor ids
DROPS = {"drop", "dropDatabase", "renameCollection"}
SCRATCH = "__emulator"


class ChangeStreamsOverWire:
    def __init__(self, server: AsyncMongoEcoProxyServer) -> None:
        self.client: Any = server._client
        self.hub: Any = self.client._change_hub
        self.executor: Any = server._executor
        self.forward = self.executor.execute_prepared
        self.executor.execute_prepared = self.execute
        self.prepare = self.executor._build_request_context
        self.executor._build_request_context = self.build
        self.cursors: dict[int, tuple[Any, str]] = {}
        self.ids = itertools.count(FIRST_ID)
        # mongoeco keeps history only while someone watches; a replica set keeps its oplog.
        self.oplog = self.client.watch([{"$match": {"_never": True}}])

    def build(self, body: dict[str, Any], **options: Any) -> Any:
        # mongoeco validates before it executes, and rejects a database-level aggregate.
        name = next((key for key in body if not key.startswith("$")), "")
        mine = (
            (name == "aggregate" and _is_change_stream(body))
            or (name == "getMore" and _cursor_id(body["getMore"]) in self.cursors)
            or (name == "killCursors" and self._mine(body))
        )
        if not mine:
            return self.prepare(body, **options)
        if options.get("on_normalized") is not None:
            options["on_normalized"](name, body)
        return _OwnCommand(options.get("db_name") or body["$db"], name, body)

    async def execute(self, context: Any) -> dict[str, Any]:
        if not isinstance(context, _OwnCommand):
            reply = await self.forward(context)  # mongoeco turns its own errors into replies
            if context.command_name in DROPS:
                await self._absorb_the_lost_event()
        else:
            reply = await self.own(context)
        if reply.get("ok") and "operationTime" not in reply:
            reply["operationTime"] = self.cluster_time()
        return reply

    async def own(self, context: _OwnCommand) -> dict[str, Any]:
        command = context.command_document
        try:
            if context.command_name == "aggregate":
                return await self.open(context.db_name, command)
            if context.command_name == "getMore":
                return await self.get_more(command)
            return self.kill(command)
        except EcoOperationFailure as error:
            code = server_error_code(error)
            return {"ok": 0.0, "errmsg": str(error)} | ({"code": code} if code else {})

    async def _absorb_the_lost_event(self) -> None:
        # mongoeco 4.11 loses the change event of the first write after a drop (its commit
        # sequence moves on without an event); a replica set's oplog loses nothing. Let a write
        # nobody watches take that loss.
        await self.client[SCRATCH].absorb.insert_one({})
        await self.client[SCRATCH].absorb.delete_many({})

    def cluster_time(self) -> Timestamp:
        # The hub's next token is "now": a stream started there sees every later commit.
        return Timestamp(self.client.change_stream_state()["nextToken"], 1)

    async def open(self, db: str, command: dict[str, Any]) -> dict[str, Any]:
        spec = command["pipeline"][0]["$changeStream"]
        target = (
            self.client[db] if command["aggregate"] == 1 else self.client[db][command["aggregate"]]
        )
        start_at = spec.get("startAtOperationTime")
        cursor = target.watch(
            command["pipeline"][1:],
            resume_after=spec.get("resumeAfter"),
            start_after=spec.get("startAfter"),
            start_at_operation_time=start_at.time if start_at is not None else None,
            full_document=spec.get("fullDocument", "default"),
            max_await_time_ms=0,
        )
        cursor_id = next(self.ids)
        ns = f"{db}.{command['aggregate'] if command['aggregate'] != 1 else '$cmd.aggregate'}"
        self.cursors[cursor_id] = (cursor, ns)
        return self._batch(cursor_id, "firstBatch", [])

    async def get_more(self, command: dict[str, Any]) -> dict[str, Any]:
        cursor_id = _cursor_id(command["getMore"])
        if cursor_id not in self.cursors:
            return {
                "ok": 0.0,
                "code": CURSOR_NOT_FOUND,
                "errmsg": f"cursor id {cursor_id} not found",
            }
        cursor, _ = self.cursors[cursor_id]
        limit = command.get("batchSize") or 1_000
        # The server holds an idle getMore open for maxTimeMS (the driver's max_await_time_ms).
        cursor._max_await_time_ms = int(command.get("maxTimeMS", 1_000))
        changes: list[dict[str, Any]] = []
        while len(changes) < limit and cursor.alive:
            change = await cursor.try_next()
            if change is None:
                break
            changes.append(change)
            cursor._max_await_time_ms = 0  # once something came, answer with what is there
        return self._batch(cursor_id, "nextBatch", changes)

    def _batch(self, cursor_id: int, key: str, changes: list[dict[str, Any]]) -> dict[str, Any]:
        cursor, ns = self.cursors[cursor_id]
        if not cursor.alive:  # an invalidate closed it
            del self.cursors[cursor_id]
            cursor_id = 0
        return {
            "cursor": {
                "id": cursor_id,  # int32 on the wire: mongoeco rejects an Int64 getMore id
                "ns": ns,
                key: changes,
                "postBatchResumeToken": self._position(cursor),
            },
            "ok": 1.0,
        }

    def _position(self, cursor: Any) -> dict[str, str]:
        """The token of the last event this cursor has gone past, matched or not: resuming
        after it misses nothing and repeats nothing, as a real post-batch token."""
        hub = self.hub
        with hub._condition:
            index = cursor._offset - hub._base_offset
            if index > 0:
                token = hub._events[index - 1].token
            elif hub._events:
                token = hub._events[0].token - 1
            else:
                token = hub._next_token - 1
        raw = json.dumps({"v": 1, "t": token}, separators=(",", ":")).encode()
        return {"_data": base64.urlsafe_b64encode(raw).decode().rstrip("=")}

    def _mine(self, command: dict[str, Any]) -> bool:
        return any(_cursor_id(value) in self.cursors for value in command.get("cursors", []))

    def kill(self, command: dict[str, Any]) -> dict[str, Any]:
        ids = [_cursor_id(value) for value in command["cursors"]]
        killed = [cursor_id for cursor_id in ids if cursor_id in self.cursors]
        for cursor_id in killed:
            self.cursors.pop(cursor_id)[0].close()
        missing = [cursor_id for cursor_id in ids if cursor_id not in killed]
        return {
            "cursorsKilled": killed,
            "cursorsNotFound": missing,
            "cursorsAlive": [],
            "cursorsUnknown": [],
            "ok": 1.0,
        }


def _cursor_id(value: Any) -> int:
    return int(getattr(value, "value", value))  # mongoeco decodes an Int64 to its BsonInt64


@dataclass
class _OwnCommand:
    db_name: str
    command_name: str
    command_document: dict[str, Any]


def _is_change_stream(command: dict[str, Any]) -> bool:
    pipeline = command.get("pipeline") or [{}]
    return isinstance(pipeline[0], dict) and "$changeStream" in pipeline[0]


async def main(port: int) -> None:
    async with AsyncMongoEcoProxyServer(host="127.0.0.1", port=port) as server:
        from importlib.metadata import version

        ChangeStreamsOverWire(server)
        print("ready", server.address.port, version("mongoeco"), flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
