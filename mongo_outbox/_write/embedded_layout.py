"""Embedded mode's layout: the events live in an array of their aggregate document, written with
it in one single-document write, atomic without a transaction.

Nothing stops two documents from holding the same event id, so the ids that can collide are
reserved in the registry before the document write (``event_ids.py`` says which, and why that
second write loses nothing); a refused document write takes its reservations back. The document
also carries the relay's bookkeeping fields (due time, claim, wait, published ids, partition),
which the outbox owns: a save keeps them, an update may not write them.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

import bson
from bson.errors import InvalidDocument
from pymongo.errors import OperationFailure, PyMongoError, WriteConcernError

from mongo_outbox._steps import Steps, call
from mongo_outbox._write.aggregates import check_size
from mongo_outbox._write.event_ids import EventIds, forget, mark
from mongo_outbox._write.layout import COUNTERS, DocumentWrite, encoded
from mongo_outbox._write.plan import Kind, Plan, Written
from mongo_outbox.errors import (
    InvalidAggregateError,
    InvalidCountersError,
    OutboxError,
    UsageError,
)
from mongo_outbox.events import Event

log = logging.getLogger(__name__)

# What the driver raises while it encodes a command, so before sending it: a value the rules
# could not see (they refuse what they can). Not InvalidOperation: a retry after a network error
# raises it for a client closed meanwhile, when the first attempt may have been applied.
_UNSENT = (InvalidDocument, OverflowError)

_REFUSED = {
    "delete": "delete_with_events is not available in embedded mode: the events of {name} live "
    "in the document it would delete. Mark the aggregate deleted with update_with_events and "
    "delete the document once its _outbox is empty, or use collection mode (docs/outbox.md, "
    "'Deleting')",
    "add": "add_events is for collection mode; in embedded mode the events go into the "
    "aggregate document: write them with update_with_events",
}


class EmbeddedLayout:
    """Entries in the array ``field`` of the documents of ``collections`` (of ``db``), their ids
    reserved in ``registry`` where they can collide."""

    entries_field: str

    def __init__(self, db: Any, collections: Sequence[str], field: str, registry: EventIds) -> None:
        self.db = db
        self.collections = tuple(collections)
        self.registry = registry
        self.entries_field = self.field = field
        self.due_field = f"{field}_due"
        self.claim_field = f"{field}_claim"
        self.wait_field = f"{field}_wait"
        self.sent_field = f"{field}_sent"
        self.partition_field = f"{field}_partition"
        self.owned = COUNTERS | {
            field,
            self.due_field,
            self.claim_field,
            self.wait_field,
            self.sent_field,
            self.partition_field,
        }

    def own_transaction(self, session: Any) -> bool:
        return False  # one single-document write

    def check_supported(self, kind: Kind, name: str) -> None:
        refused = _REFUSED.get(kind)
        if refused is not None:
            raise UsageError(refused.format(name=name))

    def check_target(self, collection: Any, session: Any) -> None:
        name = collection.name
        if name not in self.collections:
            raise InvalidAggregateError(
                f"{name} is not in this outbox's collections {list(self.collections)}: "
                "the relay would never see its events",
                collection=name,
            )
        # In a transaction the transaction's write concern counts, not the collection's.
        in_transaction = session is not None and session.in_transaction
        if not in_transaction and not collection.write_concern.acknowledged:
            raise InvalidAggregateError(
                f"{name} writes unacknowledged (w=0): the outbox could not tell whether the events "
                "were stored; use an acknowledged write concern (the default)",
                collection=name,
            )

    def entries(
        self,
        collection: Any,
        events: Sequence[Event],
        stamp: dict[str, Any],
        document_size: int,
    ) -> list[dict[str, Any]]:
        # The array holds no _id: the entry's id is under "id".
        entries, sizes = encoded(collection, events, stamp, "id")
        check_size(document_size + sum(sizes), collection.name, "the document with its new events")
        return entries

    def indexes(self, partitions: int) -> Steps[None]:
        field = self.field
        for name in self.collections:
            aggregates = self.db[name]
            if partitions > 1:
                yield call(
                    aggregates,
                    "create_index",
                    [(self.partition_field, 1), (self.due_field, 1)],
                    sparse=True,
                    name=f"{field}_partition_due",
                )
            yield call(
                aggregates, "create_index", self.due_field, sparse=True, name=f"{field}_relay_due"
            )
            # Parked entries stay in their documents; this finds them without a scan.
            yield call(
                aggregates, "create_index", f"{field}.parked", sparse=True, name=f"{field}_parked"
            )
            yield call(
                aggregates, "create_index", self.wait_field, sparse=True, name=f"{field}_wait"
            )
        yield from self.registry.ensure_index()

    def record(self, plan: Plan, session: Any, write: DocumentWrite) -> Steps[Written]:
        """Reserve the ids that can collide, write, and take the reservations back if the
        document write was refused."""
        name = plan.collection.name
        home = (plan.collection.full_name, plan.doc_id)
        in_transaction = session is not None and session.in_transaction
        # Remembered before the first database call, so that a concurrent save of the same
        # object elsewhere (another task, another thread) is refused; the home not in a
        # transaction, which the caller may abort. The copies the save returns (made from
        # plan.events) carry the marks too.
        ids, before = mark(plan.given, plan.events, home, in_transaction)
        if ids:
            plan = replace(plan, may_be_stored=tuple(ids))
        try:
            if ids:
                self.check_registry_id(plan.doc_id, name)
            reserved = yield from self.registry.reserve(ids, name, plan.doc_id, session)
        except BaseException:
            forget(before)  # the document was not written
            raise
        try:
            return (yield from write(plan, session))
        except (OutboxError, OperationFailure, *_UNSENT) as refused:
            if isinstance(refused, (WriteConcernError, InvalidCountersError)):
                raise  # the write happened (or is in a transaction that decides)
            # The document write was refused, or never sent, and wrote nothing: take the
            # reservations back. (Not after a network error or a cancellation: the write may
            # have happened.)
            forget(before)
            try:
                yield from self.registry.release(reserved, name, plan.doc_id, session)
            except PyMongoError as error:  # e.g. the transaction the refusal aborted
                # A pending reservation has no expiry: the ids stay this document's (a retry of
                # the save goes on with them), unless the aborted transaction took them along.
                log.warning(
                    "event ids %s stay reserved for %s %r unless their transaction was aborted: %s",
                    reserved,
                    name,
                    plan.doc_id,
                    error,
                )
            raise refused

    def check_registry_id(self, doc_id: Any, name: str) -> None:
        """Before reserving event ids for ``doc_id``: the registry stores it with the database's
        codec options, which may lack the uuidRepresentation its collection has."""
        if not isinstance(doc_id, uuid.UUID):
            return
        try:
            bson.encode({"_id": doc_id}, codec_options=self.db.codec_options)
        except ValueError as error:
            raise InvalidAggregateError(
                f"a UUID _id needs a uuidRepresentation on the database (the client), not on "
                f"{name} alone, to reserve event ids for it in the registry ({error})",
                collection=name,
            ) from error

    def insert_entries(
        self, plan: Plan, first: int, existed: bool, now: datetime, session: Any
    ) -> Steps[None]:
        yield from ()  # the document write carried them

    def inserted(self, plan: Plan, now: datetime) -> dict[str, Any]:
        fields: dict[str, Any] = {
            self.field: [entry | {"sequence": i} for i, entry in enumerate(plan.entries, start=1)]
        }
        if plan.events:
            fields[self.due_field] = now
        if plan.partition is not None:
            fields[self.partition_field] = plan.partition
        return fields

    def guard(self, plan: Plan) -> dict[str, Any]:
        # A retried write whose events are already pending here must not add them twice, nor
        # those the relay's last settle just removed (a retry that read their reservations an
        # instant before the relay marked them published). Only the ids that can be there: an
        # id the library made, on an object no save was given before, cannot (event_ids.py).
        ids = list(plan.may_be_stored)
        if not (plan.events and ids):
            return {}
        return {f"{self.field}.id": {"$nin": ids}, self.sent_field: {"$nin": ids}}

    def operators(self, plan: Plan, now: datetime) -> dict[str, dict[str, Any]]:
        if not plan.events:
            return {}
        # The entries go in unnumbered: an operator update cannot read the _sequence it moves,
        # and their position tells their number (_codec.numbered). $max keeps a due time in the
        # future (a relay's lease, a backoff) and makes a document with none due now.
        # One entry is pushed as itself: "$each" is for several (the emulator charges it).
        one = len(plan.entries) == 1
        ours: dict[str, dict[str, Any]] = {
            "$push": {self.field: plan.entries[0] if one else {"$each": plan.entries}},
            "$max": {self.due_field: now},
        }
        if plan.partition is not None:
            # Stored by the writer, so that a relay group's members only filter on it.
            ours["$set"] = {self.partition_field: plan.partition}
        return ours

    def stage(self, plan: Plan, now: datetime) -> dict[str, Any]:
        n = len(plan.events)
        sets: dict[str, Any] = {}
        base = {"$ifNull": ["$_sequence", 0]}
        entries = [
            {"$mergeObjects": [{"$literal": entry}, {"sequence": {"$add": [base, i]}}]}
            for i, entry in enumerate(plan.entries, start=1)
        ]
        if n or plan.kind == "save":
            sets[self.field] = {"$concatArrays": [{"$ifNull": [f"${self.field}", []]}, entries]}
            # Keep a live claim's due time, so a relay's lease survives a concurrent save.
            sets[self.due_field] = (
                {"$ifNull": [f"${self.due_field}", now]} if n else f"${self.due_field}"
            )
            if plan.partition is not None:
                # Stored by the writer, so that a relay group's members only filter on it.
                sets[self.partition_field] = {"$literal": plan.partition}
        if plan.kind == "save":
            # The relay's own fields survive a save: $replaceWith would drop them otherwise.
            sets[self.claim_field] = f"${self.claim_field}"
            sets[self.wait_field] = f"${self.wait_field}"
            sets[self.sent_field] = f"${self.sent_field}"
        return sets
