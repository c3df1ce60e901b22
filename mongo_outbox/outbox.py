"""The write side: ``Outbox.save_with_events`` and the outbox's storage layout.

Collection mode stores each event as a document of the outbox collection, written in the same
multi-document transaction as the aggregate. Embedded mode appends the events to an array field of
the aggregate document itself, so the aggregate and its events are one single-document write,
after the event ids were reserved in the registry (``_event_ids.py`` says why that second write
loses nothing).

The aggregate keeps two counters, ``_version`` (one step per save, for ``expected_version``) and
``_sequence`` (one step per event, so events carry a gap-free per-aggregate sequence), written by
``_documents.py``.

Everything that can be checked before writing is (``_aggregates.py``), so bad input writes
nothing; what only the server can find (a document grown too large with its pending entries) fails
the one write that would have stored it, inside the aborted transaction in collection mode.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from bson import ObjectId
from pymongo.errors import BulkWriteError, OperationFailure, PyMongoError

from mongo_outbox._aggregates import aggregate_id, check_size, encoded_size, type_map, type_of
from mongo_outbox._codec import encode
from mongo_outbox._documents import DocumentWriter, Plan, write_errors
from mongo_outbox._driver import DUPLICATE_KEY, start_session
from mongo_outbox._event_ids import EventIds
from mongo_outbox.errors import (
    DuplicateEventError,
    InvalidAggregateError,
    InvalidEventError,
    OutboxError,
)
from mongo_outbox.events import Event, utc_now

log = logging.getLogger(__name__)

Mode = Literal["collection", "embedded"]

_ENTRY_OVERHEAD = 32  # bytes an entry gains when stored: its sequence, its array index


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
        db: a PyMongo ``AsyncDatabase`` or a Motor database. Aggregates are saved in its
            collections only: the relay reads this client and database.
        mode: ``"collection"`` (events in the outbox collection, one transaction per save) or
            ``"embedded"`` (events inside the aggregate document, no transaction needed).
        collection: the outbox collection's name (collection mode); embedded mode keeps its
            event-id registry in ``<collection>_event_ids``.
        collections: the aggregate collections the relay scans (embedded mode, required there).
        retention: how long published entries (and embedded event-id reservations) are kept
            before the TTL index prunes them.
        field: the array field that holds embedded events.
        aggregate_types: the ``aggregate_type`` of each collection's events, where it is not the
            collection's name, e.g. ``{"orders": "Order"}``. One type per collection, and never
            another collection's name.
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
        aggregate_types: Mapping[str, str] | None = None,
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
        self.aggregate_types = type_map(aggregate_types, self.collections)
        self.event_ids = db[f"{collection}_event_ids"]
        self.field = field
        self.due_field = f"{field}_due"
        self.claim_field = f"{field}_claim"
        self.wait_field = f"{field}_wait"
        self._reserved = {"_version", "_sequence"}
        if mode == "embedded":
            self._reserved |= {field, self.due_field, self.claim_field, self.wait_field}
        self._registry = EventIds(self.event_ids, retention)
        self._documents = DocumentWriter(
            mode, field, self.due_field, self.claim_field, self.wait_field
        )

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
            await self._registry.ensure_index()

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
        ``expected_version=0`` means "must not exist yet" (a document written without the
        outbox exists too); ``N`` means "stored version is N". Fields the outbox owns
        (``_version``, ``_sequence`` and the embedded fields) are taken from the stored document,
        never from ``document``.
        """
        plan = self._plan(session, collection, document, events, expected_version)
        if self.mode == "embedded":
            return await self._write_embedded(plan, session)
        if session is not None and session.in_transaction:
            return await self._write(plan, session)
        if session is not None:
            return await _with_transaction(session, lambda s: self._write(plan, s))
        async with await start_session(self.db.client) as own:
            return await _with_transaction(own, lambda s: self._write(plan, s))

    def _plan(
        self,
        session: Any,
        collection: Any,
        document: dict[str, Any],
        events: Sequence[Event],
        expected_version: int | None,
    ) -> Plan:
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
        self._check_collection(collection, session)
        if "_id" not in document:
            if expected_version:
                raise InvalidAggregateError(
                    f"a document without _id cannot match expected_version {expected_version}",
                    collection=name,
                )
            document["_id"] = ObjectId()  # as insert_one does
        doc_id = document["_id"]
        stamp: dict[str, str | int] = {
            "aggregate_type": type_of(self.aggregate_types, name),
            "aggregate_id": aggregate_id(doc_id, name),
        }
        seen: set[str] = set()
        stamped = []
        for event in events:
            if not isinstance(event, Event):
                raise InvalidEventError(f"expected an Event, got {type(event).__name__}")
            if event.id in seen:
                raise InvalidEventError(f"event id {event.id} appears twice", event_id=event.id)
            seen.add(event.id)
            for key, value in stamp.items():
                given = getattr(event, key)
                if given is not None and given != value:
                    raise InvalidEventError(
                        f"event {event.id} has {key} {given!r}, but {name} {doc_id!r} "
                        f"publishes as {value!r}",
                        event_id=event.id,
                    )
            stamped.append(event.model_copy(update=stamp))
        body = {k: v for k, v in document.items() if k not in self._reserved}
        self._check_size(collection, body, stamped)
        return Plan(collection, body, doc_id, stamped, expected_version)

    def _check_collection(self, collection: Any, session: Any) -> None:
        name = collection.name
        database = collection.database
        # Clients are compared, not names: a namesake database of another client (or a Motor
        # database beside a PyMongo one) is out of this outbox's and its relay's sight.
        if database.client is not self.db.client or database.name != self.db.name:
            raise InvalidAggregateError(
                f"{database.name}.{name} is not a collection of the outbox's client and "
                f"database {self.db.name}: the relay would never see its events",
                collection=name,
            )
        if self.mode == "embedded" and name not in self.collections:
            raise InvalidAggregateError(
                f"{name} is not in this outbox's collections {list(self.collections)}: "
                "the relay would never see its events",
                collection=name,
            )
        if session is not None and session.client is not self.db.client:
            raise InvalidAggregateError(
                "the session belongs to another client than the outbox", collection=name
            )

    def _check_size(self, collection: Any, body: dict[str, Any], events: list[Event]) -> None:
        name = collection.name
        size = encoded_size(body, collection, "the document")
        id_key = "id" if self.mode == "embedded" else "_id"
        sizes = [
            encoded_size(encode(e, id_key), collection, f"event {e.id}") + _ENTRY_OVERHEAD
            for e in events
        ]
        if self.mode == "embedded":
            check_size(size + sum(sizes), name, "the document with its new events")
        else:
            check_size(size, name, "the document")
            for event, entry_size in zip(events, sizes, strict=True):
                check_size(entry_size, name, f"event {event.id}")

    async def _write_embedded(self, plan: Plan, session: Any) -> Saved:
        ids = [e.id for e in plan.events]
        name = plan.collection.name
        reserved = await self._registry.reserve(ids, name, plan.doc_id, session)
        try:
            return await self._write(plan, session)
        except (OutboxError, OperationFailure):
            # The document write was refused and wrote nothing: take the reservations back.
            # (Not after a network error or a cancellation: the write may have happened.)
            try:
                await self._registry.release(reserved, name, plan.doc_id, session)
            except PyMongoError as error:  # e.g. the transaction the refusal aborted
                log.warning("event ids %s stay reserved until they expire: %s", reserved, error)
            raise

    async def _write(self, plan: Plan, session: Any) -> Saved:
        n = len(plan.events)
        now = utc_now()
        version, last = await self._documents.write(plan, session, now)
        first = last - n + 1
        events = [e.model_copy(update={"sequence": first + i}) for i, e in enumerate(plan.events)]
        if self.mode == "collection" and events:
            entries = [
                encode(e, "_id") | {"status": "pending", "available_at": now, "attempts": 0}
                for e in events
            ]
            try:
                await self.collection.insert_many(entries, session=session)
            except BulkWriteError as error:
                if not any(e.get("code") == DUPLICATE_KEY for e in write_errors(error)):
                    raise
                raise DuplicateEventError(
                    f"an event id is already in {self.collection.name} (pending, or published "
                    f"less than retention ago): {error}",
                    collection=plan.collection.name,
                ) from error
        return Saved(plan.doc_id, version, events)


async def _with_transaction(session: Any, write: Callable[[Any], Awaitable[Saved]]) -> Saved:
    # with_transaction retries TransientTransactionError and UnknownTransactionCommitResult
    # as the driver spec prescribes, for up to 120 s.
    result: Saved = await session.with_transaction(write)
    return result
