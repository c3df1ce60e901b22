"""Change streams over the wire for mongoeco's emulator, the way a replica set member serves them.

mongoeco does not serve ``$changeStream`` over the wire, but its in-process client has real
change streams. ``ChangeStreamsOverWire`` answers the commands a driver's ``watch()`` sends
(``aggregate`` with ``$changeStream``, ``getMore``, ``killCursors``) from those in-process
streams: cursor ids, ``postBatchResumeToken``, ``maxTimeMS`` as the await time, error codes
286/260/43, 280 and 40324, and an ``operationTime`` on every reply; the events themselves are
made MongoDB's by ``_change_events``. So a ``pymongo.AsyncMongoClient`` in
*another process* can ``watch()``, be SIGKILLed and resume.

Every command passes through it, so it is also where the emulator answers as a replica set
member: the ``failCommand`` fail point first (``_failpoints``), the transaction rules
(``_transactions``, with ``getParameter``/``setParameter`` of the transaction lifetime and
``killAllSessions``), and a ``hello`` with a replica set's fields.

mongoeco offers no public hook for any of this: ``Internals`` is the one place that reaches into
its server, executor, change hub and cursors, and the only code here typed ``Any``.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bson import ObjectId, Timestamp
from mongoeco._change_streams.pipeline import apply_full_document_mode
from mongoeco.core.aggregation import apply_pipeline
from mongoeco.errors import OperationFailure as EcoOperationFailure
from mongoeco.wire import AsyncMongoEcoProxyServer

from mongo_outbox.testing import _numeric_ids, _unique_keys
from mongo_outbox.testing._change_events import (
    CHANGES_A_DOCUMENT,
    DISAMBIGUATED,
    RENAMED_TO,
    ChangeEvents,
    is_invalidate_token,
)
from mongo_outbox.testing._failpoints import AFTER_CURSOR_CHECKOUT, FailPoints, Hit
from mongo_outbox.testing._retried_writes import RetriedWrites
from mongo_outbox.testing._server_codes import (
    CHANGE_STREAM_FATAL,
    CURSOR_IN_USE,
    CURSOR_NOT_FOUND,
    INVALID_RESUME_TOKEN,
    UNRECOGNIZED_STAGE,
    server_error_code,
)
from mongo_outbox.testing._transactions import TransactionsOverWire

FIRST_ID = 1_000_001  # far above mongoeco's own cursor ids
NO_MATCHING_DOCUMENT = 47
IMAGES = "changeStreamPreAndPostImages"
DROPS = {"drop", "dropDatabase", "renameCollection"}
PARAMETERS = {"getParameter", "setParameter"}
FAIL_POINTS = "configureFailPoint"
KILL_ALL_SESSIONS = "killAllSessions"
HELLOS = {"hello", "isMaster", "ismaster"}
# A server also answers these commands under a second name that mongoeco does not know: PyMongo's
# ``server_info()`` sends ``buildinfo`` (Django's MongoDB backend checks the version through it).
ALIASES = {"buildinfo": "buildInfo"}
SET_NAME = "emulator"
ELECTION = ObjectId("000000000000000000000001")  # one primary, never re-elected
SCRATCH = "__emulator"

Reply = dict[str, Any]


@dataclass
class OwnCommand:
    """A change-stream command the shim answers itself, in place of mongoeco's request context."""

    db_name: str
    command_name: str
    command_document: dict[str, Any]


@dataclass
class Faulted:
    """A command the fail point hit: what it does to it comes first, the command (if it runs
    at all) after."""

    hit: Hit
    body: dict[str, Any]
    options: dict[str, Any]


@dataclass
class Refused:
    """A command of a transaction that is no longer running: it gets this reply, unrun."""

    reply: Reply


class Internals:
    """What the shim needs from mongoeco 4.11's internals, each behind a typed method."""

    def __init__(self, server: AsyncMongoEcoProxyServer) -> None:
        inside: Any = server
        self.client: Any = inside._client
        self.engine: Any = self.client._engine
        self.sessions: Any = inside._session_store
        self.hub: Any = self.client._change_hub
        self.executor: Any = inside._executor
        self.forward: Callable[[Any], Awaitable[Reply]] = self.executor.execute_prepared
        self.prepare: Callable[..., Any] = self.executor._build_request_context
        self.dispatch: Callable[..., Awaitable[bytes | None]] = inside._dispatch_wire_request
        self.hanging_up: set[int] = set()  # connection ids to close instead of replying
        inside._dispatch_wire_request = self._dispatch_or_hang_up

    async def _dispatch_or_hang_up(self, header: Any, payload: bytes, *, connection: Any) -> Any:
        response = await self.dispatch(header, payload, connection=connection)
        if connection.connection_id in self.hanging_up:
            self.hanging_up.discard(connection.connection_id)
            # mongoeco's connection loop takes a reset as the peer gone: it closes the socket
            # and sends nothing, as a server that hangs up.
            raise ConnectionResetError("closed by the failCommand fail point")
        return response

    def hang_up(self, connection: Any) -> None:
        """Close ``connection`` once its command returns, without a reply."""
        self.hanging_up.add(connection.connection_id)

    @staticmethod
    def app_name(connection: Any) -> str | None:
        """The appName the client gave in its handshake on ``connection``."""
        metadata = getattr(connection, "client_metadata", None) or {}
        name = (metadata.get("application") or {}).get("name")
        return name if isinstance(name, str) else None

    def intercept(
        self, build: Callable[..., Any], execute: Callable[[Any], Awaitable[Reply]]
    ) -> None:
        """Route every request through ``build`` (validation) and ``execute`` (answer)."""
        self.executor._build_request_context = build
        self.executor.execute_prepared = execute

    def watch(
        self, db: str | None, collection: str | None, pipeline: list[Any], **options: Any
    ) -> Any:
        target = (
            self.client
            if db is None
            else self.client[db]
            if collection is None
            else self.client[db][collection]
        )
        return target.watch(pipeline, **options)

    def next_token(self) -> int:
        return int(self.client.change_stream_state()["nextToken"])

    def last_token_passed(self, cursor: Any) -> int:
        """The token of the last event ``cursor`` has gone past, matched or not."""
        hub = self.hub
        with hub._condition:
            index = cursor._offset - hub._base_offset
            if index > 0:
                return int(hub._events[index - 1].token)
            if hub._events:
                return int(hub._events[0].token) - 1
            return int(hub._next_token) - 1

    @staticmethod
    def offset(cursor: Any) -> int:
        """Where in the change history ``cursor`` is."""
        return int(cursor._offset)

    def end_offset(self) -> int:
        """Where the change history ends now."""
        hub = self.hub
        with hub._condition:
            return int(hub._end_offset_locked())

    @staticmethod
    def await_for(cursor: Any, milliseconds: int) -> None:
        cursor._max_await_time_ms = milliseconds

    @staticmethod
    def collection_level(cursor: Any) -> bool:
        return cursor._scope.coll_name is not None

    async def next_event(self, cursor: Any) -> Any:
        """The next of mongoeco's events in ``cursor``'s scope, or None after its await time.
        (Its own ``try_next`` ends a database's stream at a dropped collection.)"""
        deadline = time.monotonic() + (cursor._max_await_time_ms or 0) / 1000
        while cursor.alive:
            offset, event = await self.hub.wait_for_event_async(
                cursor._offset,
                timeout_seconds=max(0.0, deadline - time.monotonic()),
                stop_event=cursor._stop_event,
            )
            cursor._offset = offset
            if event is None:
                return None
            if cursor._scope.matches(event):
                return event
        return None

    @staticmethod
    def transform(cursor: Any, document: dict[str, Any]) -> dict[str, Any] | None:
        """``document`` through the stream's fullDocument mode and pipeline, as mongoeco's
        cursor does it."""
        document = apply_full_document_mode(document, cursor._full_document)
        if cursor._pipeline is not None:
            transformed = apply_pipeline([document], cursor._pipeline)
            if not transformed:
                return None
            document = transformed[0]
        result: dict[str, Any] = cursor._materialize_document(document)
        return result

    async def scratch_write(self) -> None:
        await self.client[SCRATCH].absorb.insert_one({})
        await self.client[SCRATCH].absorb.delete_many({})


class ChangeStreamsOverWire:
    def __init__(self, server: AsyncMongoEcoProxyServer) -> None:
        self.mongoeco = Internals(server)
        self.mongoeco.intercept(self.build, self.execute)
        self.transactions = TransactionsOverWire(
            self.mongoeco.engine, self.mongoeco.sessions, self.mongoeco.client
        )
        _numeric_ids.install(self.mongoeco.engine)
        _unique_keys.install(self.mongoeco.engine)
        self.events = ChangeEvents(self.mongoeco.engine, self.mongoeco.hub)
        self.transactions.rules.on_commit = lambda first, last, txn: self.events.committed(
            first, last, txn.lsid, txn.txn_number
        )
        self.pending: dict[int, list[dict[str, Any]]] = {}  # events owed to a full batch
        self.specs: dict[int, dict[str, Any]] = {}  # each cursor's $changeStream options
        # The collections with changeStreamPreAndPostImages (collMod or create).
        self.images: set[tuple[str, str]] = set()
        self.failpoints = FailPoints()
        self.cursor_failpoints = FailPoints(name=AFTER_CURSOR_CHECKOUT)
        self.retried = RetriedWrites()
        self.me = f"127.0.0.1:{server.address.port}"
        self.cursors: dict[int, tuple[Any, str]] = {}
        self.in_use: set[int] = set()  # cursors a getMore is working on
        self.ids = itertools.count(FIRST_ID)
        # mongoeco keeps history only while someone watches; a replica set keeps its oplog.
        self.oplog = self.mongoeco.client.watch([{"$match": {"_never": True}}])

    def build(self, body: dict[str, Any], **options: Any) -> Any:
        # The fail point first, as a server evaluates it before the command's session.
        app = self.mongoeco.app_name(options.get("connection"))
        hit = self.failpoints.hit(body, app)
        if hit is None and "getMore" in body and _cursor_id(body["getMore"]) in self.cursors:
            hit = self.cursor_failpoints.hit(body, app)
        if hit is not None:
            return Faulted(hit, body, options)
        return self._build(body, **options)

    def _build(self, body: dict[str, Any], **options: Any) -> Any:
        first = next(iter(body), "")
        if first in ALIASES:
            body = {ALIASES[first] if key == first else key: value for key, value in body.items()}
        # Before mongoeco sees it: mongoeco would run a dead transaction's command outside it.
        refusal = self.transactions.refuse(body)
        if refusal is not None:
            return Refused(refusal)
        # mongoeco validates before it executes, and rejects a database-level aggregate.
        name = next((key for key in body if not key.startswith("$")), "")
        if name == "renameCollection" and (options.get("db_name") or body.get("$db")) == "admin":
            # Drivers send it to admin with whole namespaces; mongoeco takes it only on the
            # database of both.
            source = str(body["renameCollection"]).partition(".")[0]
            if source == str(body.get("to", "")).partition(".")[0]:
                body["$db"] = source
                if "db_name" in options:
                    options["db_name"] = source
        if name == "create" and IMAGES in body:
            # mongoeco knows no such option: the shim keeps it, mongoeco creates the collection.
            self._keep_images(
                options.get("db_name") or body["$db"], body["create"], body.pop(IMAGES)
            )
        mine = (
            (name == "collMod" and _only_images(body))
            or (name == "aggregate" and _is_change_stream(body))
            or (name == "getMore" and _cursor_id(body["getMore"]) in self.cursors)
            or (name == "killCursors" and self._mine(body))
            or name in PARAMETERS
            or name in (FAIL_POINTS, KILL_ALL_SESSIONS)
        )
        if not mine:
            return self.mongoeco.prepare(body, **options)
        if options.get("on_normalized") is not None:
            options["on_normalized"](name, body)
        return OwnCommand(options.get("db_name") or body["$db"], name, body)

    async def execute(self, context: Any) -> Reply:
        before = self.mongoeco.next_token()
        reply = await self._execute(context)
        # A replica set member times every reply, an error too: a causally consistent session
        # reads after it (its next transaction's first read concern has afterClusterTime). A
        # write's is its own event's time, so that a stream started at it sees it.
        if "operationTime" not in reply:
            reply["operationTime"] = self.cluster_time(wrote=self.mongoeco.next_token() > before)
        return reply

    async def _execute(self, context: Any) -> Reply:
        if isinstance(context, Faulted):
            reply = await self.faulted(context)
        elif isinstance(context, Refused):
            reply = context.reply
        elif not isinstance(context, OwnCommand):
            # mongoeco turns its errors into replies; the rules turn conflicts into a server's
            # A retried write is answered from its first try's record, as by a server.
            reply = await self.retried.run(
                context.raw_body,
                lambda: self.transactions.run(
                    context.raw_body, lambda: self.mongoeco.forward(context)
                ),
            )
            if context.command_name == "renameCollection" and reply.get("ok"):
                self._publish_rename(context.raw_body)
            if context.command_name in DROPS:
                await self._absorb_the_lost_event()
            if context.command_name in HELLOS and reply.get("ok"):
                reply.update(self.replica_set_member())
        else:
            reply = await self.own(context)
        return reply

    def replica_set_member(self) -> Reply:
        """What a single-node replica set's primary adds to its hello: a driver then runs
        retryable writes, commit and abort retries and read preference rules as against
        one. (mongoeco's hello, without setName, made it a standalone.)"""
        return {
            "setName": SET_NAME,
            "setVersion": 1,
            "hosts": [self.me],
            "primary": self.me,
            "me": self.me,
            "secondary": False,
            "electionId": ELECTION,
        }

    async def faulted(self, context: Faulted) -> Reply:
        hit, body = context.hit, context.body
        if hit.block_ms:
            await asyncio.sleep(hit.block_ms / 1000)
        if hit.close_connection:
            self.mongoeco.hang_up(context.options.get("connection"))
            return {"ok": 0.0, "errmsg": "never sent: the connection is closed"}
        if hit.error_code is not None:
            return hit.error_reply(body, change_stream=hit.in_cursor)
        reply = await self.execute(self._build(body, **context.options))
        if hit.write_concern_error is not None and reply.get("ok"):
            hit.add_write_concern_error(body, reply)
        return reply

    async def own(self, context: OwnCommand) -> Reply:
        command = context.command_document
        try:
            if context.command_name == "aggregate":
                return self.open(context.db_name, command)
            if context.command_name == "getMore":
                return await self.get_more(command)
            if context.command_name in PARAMETERS:
                return self.transactions.parameter(command)
            if context.command_name == "collMod":
                self._keep_images(context.db_name, command["collMod"], command[IMAGES])
                return {"ok": 1.0}
            if context.command_name == KILL_ALL_SESSIONS:
                return self.transactions.kill_all_sessions()
            if context.command_name == FAIL_POINTS:
                if command.get(FAIL_POINTS) == AFTER_CURSOR_CHECKOUT:
                    return self.cursor_failpoints.configure(command)
                return self.failpoints.configure(command)
            return self.kill(command)
        except EcoOperationFailure as error:
            code = server_error_code(error)
            return {"ok": 0.0, "errmsg": str(error)} | ({"code": code} if code else {})

    def _publish_rename(self, body: dict[str, Any]) -> None:
        """The rename event MongoDB sends (mongoeco sends none); the write after it, which
        mongoeco then loses, is the shim's own (_absorb_the_lost_event)."""
        source_db, _, source = str(body["renameCollection"]).partition(".")
        target_db, _, target = str(body.get("to", "")).partition(".")
        self.mongoeco.hub.publish(
            operation_type="rename",
            db_name=source_db,
            coll_name=source,
            document_key={},
            update_description={RENAMED_TO: {"db": target_db, "coll": target}},
        )

    def _keep_images(self, db: str, collection: str, option: Any) -> None:
        if isinstance(option, dict) and option.get("enabled"):
            self.images.add((db, collection))
        else:
            self.images.discard((db, collection))

    async def _absorb_the_lost_event(self) -> None:
        # mongoeco 4.11 loses the change event of the first write after a drop (its commit
        # sequence moves on without an event); a replica set's oplog loses nothing. Let a write
        # nobody watches take that loss.
        await self.mongoeco.scratch_write()

    def cluster_time(self, *, wrote: bool = False) -> Timestamp:
        """The time of the last event if the command wrote it, else just after it: a stream
        started there sees every later commit."""
        last = self.mongoeco.next_token() - 1
        return self.events.time_of(last) if wrote else self.events.after(last)

    def open(self, db: str, command: dict[str, Any]) -> Reply:
        spec = command["pipeline"][0]["$changeStream"]
        collection = None if command["aggregate"] == 1 else command["aggregate"]
        start_at = spec.get("startAtOperationTime")
        resume_after = spec.get("resumeAfter")
        if resume_after is not None and is_invalidate_token(resume_after):
            return {
                "ok": 0.0,
                "code": INVALID_RESUME_TOKEN,
                "codeName": "InvalidResumeToken",
                "errmsg": "cannot resume a stream after an invalidate: use startAfter",
            }
        unknown = _unknown_stage(command["pipeline"][1:])
        if unknown is not None:
            return {
                "ok": 0.0,
                "code": UNRECOGNIZED_STAGE,
                "codeName": "Location40324",
                "errmsg": f"Unrecognized pipeline stage name: '{unknown}'",
            }
        everything = spec.get("allChangesForCluster") and db == "admin"  # client.watch()
        cursor = self.mongoeco.watch(
            None if everything else db,
            collection,
            command["pipeline"][1:],
            resume_after=resume_after,
            start_after=spec.get("startAfter"),
            start_at_operation_time=(
                self.events.start_token(start_at) if start_at is not None else None
            ),
            full_document=spec.get("fullDocument", "default"),
            max_await_time_ms=0,
        )
        cursor_id = next(self.ids)
        self.cursors[cursor_id] = (cursor, f"{db}.{collection or '$cmd.aggregate'}")
        self.specs[id(cursor)] = dict(spec)
        return self._batch(cursor_id, "firstBatch", [])

    async def get_more(self, command: dict[str, Any]) -> Reply:
        cursor_id = _cursor_id(command["getMore"])
        if cursor_id not in self.cursors:
            return _not_found(cursor_id)
        if cursor_id in self.in_use:  # it yields between events: one getMore at a time
            return {
                "ok": 0.0,
                "code": CURSOR_IN_USE,
                "codeName": "CursorInUse",
                "errmsg": f"cursor id {cursor_id} is already in use",
            }
        self.in_use.add(cursor_id)
        try:
            return await self._get_more(cursor_id, command)
        except EcoOperationFailure:
            # History lost under it (past the events kept): a server kills such a cursor.
            self.kill({"cursors": [cursor_id]})
            raise
        finally:
            self.in_use.discard(cursor_id)

    async def _get_more(self, cursor_id: int, command: dict[str, Any]) -> Reply:
        cursor, _ = self.cursors[cursor_id]
        limit = command.get("batchSize") or 1_000
        # The server holds an idle getMore open for maxTimeMS (the driver's max_await_time_ms).
        self.mongoeco.await_for(cursor, int(command.get("maxTimeMS", 1_000)))
        changes = self.pending.pop(cursor_id, [])
        there = None  # where history ended when the first event came
        while len(changes) < limit and cursor.alive:
            if there is not None and self.mongoeco.offset(cursor) >= there:
                break  # what came since is the next getMore's: this one answers
            event = await self.mongoeco.next_event(cursor)
            if event is None:
                break
            if there is None:
                # Once something came, answer with what is there: not with what writers add
                # while this one yields, which would hold the batch until it is full.
                self.mongoeco.await_for(cursor, 0)
                there = self.mongoeco.end_offset()
            try:
                changes += self._served(cursor, event)
            except ImageMissing as error:
                self.kill({"cursors": [cursor_id]})
                return {
                    "ok": 0.0,
                    "code": NO_MATCHING_DOCUMENT,
                    "codeName": "NoMatchingDocument",
                    "errmsg": str(error),
                }
            except ChangeStreamFatal as error:
                self.kill({"cursors": [cursor_id]})
                return {
                    "ok": 0.0,
                    "code": CHANGE_STREAM_FATAL,
                    "codeName": "ChangeStreamFatalError",
                    "errmsg": str(error),
                    "errorLabels": ["NonResumableChangeStreamError"],
                }
            # A server serves its other connections while a getMore works through a backlog
            # (1,000 events of embedded-mode updates cost the emulator about 0.5 s): a lease
            # renewal must not wait on it.
            await asyncio.sleep(0)
        if cursor_id not in self.cursors:  # killed (killCursors) while it yielded
            return _not_found(cursor_id)
        if len(changes) > limit:
            self.pending[cursor_id] = changes[limit:]
            changes = changes[:limit]
        return self._batch(cursor_id, "nextBatch", changes)

    def _images(self, document: dict[str, Any], before: Any, spec: dict[str, Any]) -> None:
        """fullDocument and fullDocumentBeforeChange as asked, where the collection keeps its
        pre- and post-images (changeStreamPreAndPostImages, read when the event is sent)."""
        operation = document["operationType"]
        if operation not in CHANGES_A_DOCUMENT:
            return
        ns = document.get("ns") or {}
        kept = (ns.get("db"), ns.get("coll")) in self.images
        wanted = spec.get("fullDocumentBeforeChange", "off")
        if wanted in ("whenAvailable", "required"):
            if kept and before is not None:
                document["fullDocumentBeforeChange"] = before
            elif wanted == "required":
                raise ImageMissing("the event's pre-image is required but was not found")
            else:
                document["fullDocumentBeforeChange"] = None
        wanted = spec.get("fullDocument", "default")
        if operation == "update" and wanted in ("whenAvailable", "required") and not kept:
            if wanted == "required":
                raise ImageMissing("the event's post-image is required but was not found")
            document["fullDocument"] = None

    def _served(self, cursor: Any, event: Any) -> list[dict[str, Any]]:
        """What a stream sends for one of mongoeco's events: MongoDB's event through the
        stream's pipeline, and after the drop of its own collection an invalidate that ends it."""
        document, before = self.events.document(event)
        spec = self.specs.get(id(cursor), {})
        if not spec.get("showExpandedEvents"):
            document.get("updateDescription", {}).pop(DISAMBIGUATED, None)
        self._images(document, before, spec)
        served = []
        transformed = self.mongoeco.transform(cursor, document)
        if transformed is not None:
            if transformed.get("_id") != document["_id"]:
                raise ChangeStreamFatal(
                    "Encountered an event whose _id field, which contains the resume token, "
                    "was modified by the pipeline. Modifying the _id field of an event makes "
                    "it impossible to resume the stream from that point."
                )
            served.append(transformed)
        ends = document["operationType"] in ("drop", "rename")
        if ends and self.mongoeco.collection_level(cursor):
            served.append(
                self.events.invalidate(event, document["clusterTime"], document.get("wallTime"))
            )
            cursor.close()
        return served

    def _batch(self, cursor_id: int, key: str, changes: list[dict[str, Any]]) -> Reply:
        cursor, ns = self.cursors[cursor_id]
        if not cursor.alive:  # an invalidate closed it
            del self.cursors[cursor_id]
            self.specs.pop(id(cursor), None)
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
        """Resuming after the last event the cursor has gone past misses nothing and repeats
        nothing, as a real post-batch token."""
        token = self.mongoeco.last_token_passed(cursor)
        raw = json.dumps({"v": 1, "t": token}, separators=(",", ":")).encode()
        return {"_data": base64.urlsafe_b64encode(raw).decode().rstrip("=")}

    def _mine(self, command: dict[str, Any]) -> bool:
        return any(_cursor_id(value) in self.cursors for value in command.get("cursors", []))

    def kill(self, command: dict[str, Any]) -> Reply:
        ids = [_cursor_id(value) for value in command["cursors"]]
        killed = [cursor_id for cursor_id in ids if cursor_id in self.cursors]
        for cursor_id in killed:
            cursor = self.cursors.pop(cursor_id)[0]
            self.specs.pop(id(cursor), None)
            self.pending.pop(cursor_id, None)
            cursor.close()
        missing = [cursor_id for cursor_id in ids if cursor_id not in killed]
        return {
            "cursorsKilled": killed,
            "cursorsNotFound": missing,
            "cursorsAlive": [],
            "cursorsUnknown": [],
            "ok": 1.0,
        }


class ChangeStreamFatal(Exception):
    """An event the stream cannot send (code 280): the cursor dies with it."""


class ImageMissing(Exception):
    """A pre- or post-image the stream requires and the collection does not keep (code 47)."""


# The stages a change stream's pipeline may hold, and the aggregation stages a server knows
# (any other name is refused with 40324 before the stream opens).
KNOWN_STAGES = frozenset(
    {
        "$match", "$project", "$addFields", "$set", "$unset", "$replaceRoot", "$replaceWith",
        "$redact", "$changeStreamSplitLargeEvent", "$group", "$sort", "$limit", "$skip",
        "$lookup", "$unwind", "$count", "$facet", "$out", "$merge", "$sample", "$bucket",
        "$bucketAuto", "$sortByCount", "$graphLookup", "$unionWith", "$densify", "$fill",
        "$setWindowFields", "$documents", "$geoNear", "$indexStats", "$collStats",
        "$currentOp", "$listSessions", "$planCacheStats", "$search", "$searchMeta",
    }
)  # fmt: skip


def _only_images(body: dict[str, Any]) -> bool:
    """A collMod that changes changeStreamPreAndPostImages alone (mongoeco has no collMod)."""
    return {key for key in body if not key.startswith("$") and key != "lsid"} == {"collMod", IMAGES}


def _unknown_stage(pipeline: list[Any]) -> str | None:
    for stage in pipeline:
        if isinstance(stage, dict):
            name = next(iter(stage), "")
            if name not in KNOWN_STAGES:
                return str(name)
    return None


def _not_found(cursor_id: int) -> Reply:
    return {"ok": 0.0, "code": CURSOR_NOT_FOUND, "errmsg": f"cursor id {cursor_id} not found"}


def _cursor_id(value: Any) -> int:
    return int(getattr(value, "value", value))  # mongoeco decodes an Int64 to its BsonInt64


def _is_change_stream(command: dict[str, Any]) -> bool:
    pipeline = command.get("pipeline") or [{}]
    return isinstance(pipeline[0], dict) and "$changeStream" in pipeline[0]
