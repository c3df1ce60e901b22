"""The write side: ``Outbox.save_with_events`` and the outbox's storage layout.

Collection mode stores each event as a document of the outbox collection, written in the same
multi-document transaction as the aggregate. Embedded mode appends the events to an array field of
the aggregate document itself, so the aggregate and its events are one single-document write.

Either way the aggregate is written with one ``findAndModify`` whose update pipeline keeps two
counters on the document: ``_version`` (one step per save, for ``expected_version``) and
``_sequence`` (one step per event, so events carry a gap-free per-aggregate sequence).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from bson import ObjectId
from pymongo import ReturnDocument
from pymongo.errors import BulkWriteError, DuplicateKeyError

from mongo_outbox._codec import encode
from mongo_outbox._driver import start_session
from mongo_outbox.errors import (
    ConcurrencyError,
    DuplicateEventError,
    InvalidAggregateError,
    InvalidEventError,
)
from mongo_outbox.events import AggregateId, Event, utc_now

Mode = Literal["collection", "embedded"]


@dataclass(frozen=True)
class Saved:
    """What ``save_with_events`` wrote: the aggregate's ``_id``, its new version and the events
    as stored (with ``aggregate_type``, ``aggregate_id`` and ``sequence`` filled in)."""

    id: Any
    version: int
    events: list[Event]


class Outbox:
    """Writes aggregates with their events, and knows where the relay finds them.

    Parameters:
        db: a PyMongo ``AsyncDatabase`` or a Motor database.
        mode: ``"collection"`` (events in the outbox collection, one transaction per save) or
            ``"embedded"`` (events inside the aggregate document, no transaction needed).
        collection: the outbox collection's name (collection mode).
        collections: the aggregate collections the relay scans (embedded mode, required there).
        retention: how long published entries are kept before the TTL index prunes them.
        field: the array field that holds embedded events.
    """

    def __init__(
        self,
        db: Any,
        *,
        mode: Mode = "collection",
        collection: str = "outbox",
        collections: Sequence[str] = (),
        retention: timedelta = timedelta(days=7),
        field: str = "_outbox",
    ) -> None:
        if mode not in ("collection", "embedded"):
            raise ValueError(f"mode must be 'collection' or 'embedded', not {mode!r}")
        if mode == "embedded" and not collections:
            raise ValueError("embedded mode needs collections=[...]: the relay scans only those")
        if retention <= timedelta(0):
            raise ValueError("retention must be positive")
        self.db = db
        self.mode: Mode = mode
        self.retention = retention
        self.collection = db[collection]
        self.collections = tuple(collections)
        self.field = field
        self.due_field = f"{field}_due"
        self.claim_field = f"{field}_claim"
        self.wait_field = f"{field}_wait"
        self._reserved = {"_version", "_sequence"}
        if mode == "embedded":
            self._reserved |= {field, self.due_field, self.claim_field, self.wait_field}

    async def ensure_indexes(self) -> None:
        """Create the indexes the relay and the TTL pruning need. Idempotent."""
        if self.mode == "collection":
            await self.collection.create_index(
                [("status", 1), ("available_at", 1)], name="relay_due"
            )
            await self.collection.create_index(
                [("aggregate_type", 1), ("aggregate_id", 1), ("sequence", 1)], name="aggregate"
            )
            # Only published entries get expire_at, so pending ones never expire.
            await self.collection.create_index("expire_at", expireAfterSeconds=0, name="ttl")
            # Entries waiting for the broker, woken at once when it is back.
            await self.collection.create_index("waiting", sparse=True, name="waiting")
        else:
            for name in self.collections:
                await self.db[name].create_index(
                    self.due_field, sparse=True, name=f"{self.field}_relay_due"
                )
                # Parked entries stay in their documents; this finds them without a scan.
                await self.db[name].create_index(
                    f"{self.field}.parked", sparse=True, name=f"{self.field}_parked"
                )
                await self.db[name].create_index(
                    self.wait_field, sparse=True, name=f"{self.field}_wait"
                )

    async def save_with_events(
        self,
        session: Any,
        collection: Any,
        document: dict[str, Any],
        events: Sequence[Event],
        *,
        expected_version: int | None = None,
    ) -> Saved:
        """Insert or replace ``document`` (by ``_id``) and record ``events``, atomically.

        ``session`` may be ``None``; in collection mode a session and transaction are then
        started here. A session inside an open transaction is joined and not committed.
        ``expected_version=0`` means "must not exist yet"; ``N`` means "stored version is N".
        Fields the outbox owns (``_version``, ``_sequence`` and the embedded fields) are taken
        from the stored document, never from ``document``.
        """
        plan = self._plan(session, collection, document, events, expected_version)
        if self.mode == "embedded":
            return await self._write(plan, session)
        if session is not None and session.in_transaction:
            return await self._write(plan, session)
        if session is not None:
            return await _with_transaction(session, lambda s: self._write(plan, s))
        async with await start_session(collection.database.client) as own:
            return await _with_transaction(own, lambda s: self._write(plan, s))

    def _plan(
        self,
        session: Any,
        collection: Any,
        document: dict[str, Any],
        events: Sequence[Event],
        expected_version: int | None,
    ) -> _Plan:
        name = collection.name
        if not isinstance(document, Mapping):
            raise InvalidAggregateError("the document must be a mapping", collection=name)
        if expected_version is not None and (
            isinstance(expected_version, bool)
            or not isinstance(expected_version, int)
            or expected_version < 0
        ):
            raise InvalidAggregateError(
                f"expected_version must be an int >= 0, not {expected_version!r}", collection=name
            )
        if collection.database.name != self.db.name:
            raise InvalidAggregateError(
                f"{name} is in database {collection.database.name}, the outbox in {self.db.name}",
                collection=name,
            )
        if self.mode == "embedded" and name not in self.collections:
            raise InvalidAggregateError(
                f"{name} is not in this outbox's collections {list(self.collections)}: "
                "the relay would never see its events",
                collection=name,
            )
        if session is not None and session.client is not collection.database.client:
            raise InvalidAggregateError(
                "the session belongs to another client than the collection", collection=name
            )
        if "_id" not in document:
            if expected_version:
                raise InvalidAggregateError(
                    f"a document without _id cannot match expected_version {expected_version}",
                    collection=name,
                )
            document["_id"] = ObjectId()  # as insert_one does
        doc_id = document["_id"]
        aggregate_id = _aggregate_id(doc_id, name)
        seen: set[str] = set()
        stamped = []
        for event in events:
            if not isinstance(event, Event):
                raise InvalidEventError(f"expected an Event, got {type(event).__name__}")
            if event.id in seen:
                raise InvalidEventError(f"event id {event.id} appears twice", event_id=event.id)
            seen.add(event.id)
            if event.aggregate_id is not None and event.aggregate_id != aggregate_id:
                raise InvalidEventError(
                    f"event {event.id} is for aggregate {event.aggregate_id!r}, "
                    f"not {aggregate_id!r}",
                    event_id=event.id,
                )
            if event.aggregate_type is None:
                event = event.model_copy(update={"aggregate_type": name})
            stamped.append(event.model_copy(update={"aggregate_id": aggregate_id}))
        body = {k: v for k, v in document.items() if k not in self._reserved}
        return _Plan(collection, body, doc_id, stamped, expected_version)

    async def _write(self, plan: _Plan, session: Any) -> Saved:
        n = len(plan.events)
        now = utc_now()
        sets: dict[str, Any] = {
            "_version": {"$add": [{"$ifNull": ["$_version", 0]}, 1]},
            "_sequence": {"$add": [{"$ifNull": ["$_sequence", 0]}, n]},
        }
        if self.mode == "embedded":
            base = {"$ifNull": ["$_sequence", 0]}
            entries = [
                {
                    "$mergeObjects": [
                        {"$literal": encode(e, "id")},
                        {"sequence": {"$add": [base, i]}},
                    ]
                }
                for i, e in enumerate(plan.events, start=1)
            ]
            sets[self.field] = {"$concatArrays": [{"$ifNull": [f"${self.field}", []]}, entries]}
            # Keep a live claim's due time, so a relay's lease survives a concurrent save.
            sets[self.due_field] = (
                {"$ifNull": [f"${self.due_field}", now]} if n else f"${self.due_field}"
            )
            sets[self.claim_field] = f"${self.claim_field}"
            sets[self.wait_field] = f"${self.wait_field}"
        pipeline = [{"$replaceWith": {"$mergeObjects": [{"$literal": plan.body}, sets]}}]
        query: dict[str, Any] = {"_id": plan.doc_id}
        if plan.expected_version is not None:
            # Matching null also matches a document saved before it had a version.
            query["_version"] = plan.expected_version or None
        try:
            stored = await plan.collection.find_one_and_update(
                query,
                pipeline,
                upsert=plan.expected_version in (None, 0),
                projection={"_version": 1, "_sequence": 1},
                return_document=ReturnDocument.AFTER,
                session=session,
            )
        except DuplicateKeyError as error:
            if plan.expected_version is None:
                raise
            # The upsert found no document at the expected version and collided with the real one.
            raise _conflict(plan) from error
        if stored is None:
            raise _conflict(plan)
        first = stored["_sequence"] - n + 1
        events = [e.model_copy(update={"sequence": first + i}) for i, e in enumerate(plan.events)]
        if self.mode == "collection" and events:
            entries = [
                encode(e, "_id") | {"status": "pending", "available_at": now, "attempts": 0}
                for e in events
            ]
            try:
                await self.collection.insert_many(entries, session=session)
            except BulkWriteError as error:
                if not any(e.get("code") == 11000 for e in error.details.get("writeErrors", [])):
                    raise
                raise DuplicateEventError(
                    f"an event id is already in {self.collection.name}: {error}",
                    collection=plan.collection.name,
                ) from error
        return Saved(plan.doc_id, stored["_version"], events)


@dataclass(frozen=True)
class _Plan:
    collection: Any
    body: dict[str, Any]
    doc_id: Any
    events: list[Event]
    expected_version: int | None


def _conflict(plan: _Plan) -> ConcurrencyError:
    return ConcurrencyError(
        f"{plan.collection.name} {plan.doc_id!r} is not at version {plan.expected_version}",
        collection=plan.collection.name,
        aggregate_id=plan.doc_id,
        expected_version=plan.expected_version or 0,
    )


def _aggregate_id(doc_id: Any, collection: str) -> AggregateId:
    if isinstance(doc_id, str) or (isinstance(doc_id, int) and not isinstance(doc_id, bool)):
        return doc_id
    if isinstance(doc_id, (ObjectId, uuid.UUID)):
        return str(doc_id)
    raise InvalidAggregateError(
        f"_id of type {type(doc_id).__name__} is not supported: use a str, int, ObjectId or UUID",
        collection=collection,
    )


async def _with_transaction(session: Any, write: Callable[[Any], Awaitable[Saved]]) -> Saved:
    # with_transaction retries TransientTransactionError and UnknownTransactionCommitResult
    # as the driver spec prescribes, for up to 120 s.
    result: Saved = await session.with_transaction(write)
    return result
