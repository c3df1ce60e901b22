"""Collection mode's layout: each event is a document of the outbox collection, its ``_id`` the
event id, inserted in the same multi-document transaction as the aggregate document. A reused
event id fails that insert, so no registry is needed; the aggregate document holds its counters
only.

A reused sequence is refused too: the unique index ``aggregate_sequence`` holds one entry per
``(aggregate_type, aggregate_id, sequence)``, and a write that numbers from 1 the events of a
document that was there before it (the document write says so) first looks for events of that
aggregate in the outbox: one indexed read, only then. Either finds an aggregate whose document
lost its counters (replaced without the outbox's fields, by an ODM's own ``replace`` or ``save``
of a new object) or was deleted and created again under its ``_id``: its events would repeat
sequences consumers have seen, so the write is refused (``DuplicateSequenceError``) and its
transaction aborted. Both see the entries the outbox keeps (pending, and published ones for
``retention``): an aggregate with none left cannot be told from a new one. The look-up also
catches a lost counter whose sequence 1 was pruned already; a document the write created (an
aggregate deleted and created again) is refused by the index alone, for the sequences it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pymongo.errors import BulkWriteError, DuplicateKeyError

from mongo_outbox._driver import DUPLICATE_KEY
from mongo_outbox._steps import Steps, call, listing
from mongo_outbox._storage import (
    ATTEMPTS,
    AVAILABLE_AT,
    EXPIRE_AT,
    PENDING,
    SEQUENCES,
    STATUS,
    WAITING,
)
from mongo_outbox._write.aggregates import check_size
from mongo_outbox._write.layout import COUNTERS, DocumentWrite, encoded
from mongo_outbox._write.plan import Kind, Plan, Written
from mongo_outbox._write.refusals import duplicate_id, duplicate_key, write_errors
from mongo_outbox.errors import DuplicateEventError, DuplicateSequenceError
from mongo_outbox.events import Event

# The unique index of sequences (SEQUENCES): its keys in another order than the "aggregate"
# index's, as a server before 5.0 (and the emulator) refuses a second index of the same keys.
# Entries without a numeric sequence (another producer's, a hand-written one: the relay parks
# them) are left out.
_SEQUENCE_KEYS = [("aggregate_id", 1), ("aggregate_type", 1), ("sequence", 1)]
_NUMBERED = {"sequence": {"$type": "number"}}
_SHOWN = 10  # duplicates an index build that failed names


class CollectionLayout:
    """Entries in ``outbox`` (a collection); ``field`` is the embedded name the outbox was given,
    whose due field the reads after a refused write ask for all the same (none is stored)."""

    owned = COUNTERS
    partition_field = "partition"
    entries_field = None

    def __init__(self, outbox: Any, field: str) -> None:
        self.outbox = outbox
        self.due_field = f"{field}_due"

    def own_transaction(self, session: Any) -> bool:
        # A write goes to two collections, unless the caller's transaction holds them already.
        return not (session is not None and session.in_transaction)

    def check_supported(self, kind: Kind, name: str) -> None:
        return None  # every write: the entries outlive the aggregate document

    def check_target(self, collection: Any, session: Any) -> None:
        # Every write is in a transaction, whose write concern counts, not the collection's.
        return None

    def entries(
        self,
        collection: Any,
        events: Sequence[Event],
        stamp: dict[str, Any],
        document_size: int,
    ) -> list[dict[str, Any]]:
        name = collection.name
        entries, sizes = encoded(collection, events, stamp, "_id")
        check_size(document_size, name, "the document")
        for event, entry_size in zip(events, sizes, strict=True):
            check_size(entry_size, name, f"event {event.id}")
        return entries

    def indexes(self, partitions: int) -> Steps[None]:
        outbox = self.outbox
        if partitions > 1:
            # A group member's claims: its partition's due entries.
            yield call(
                outbox,
                "create_index",
                [("partition", 1), (STATUS, 1), (AVAILABLE_AT, 1)],
                name="relay_partition_due",
            )
        yield call(outbox, "create_index", [(STATUS, 1), (AVAILABLE_AT, 1)], name="relay_due")
        yield call(
            outbox,
            "create_index",
            [("aggregate_type", 1), ("aggregate_id", 1), ("sequence", 1)],
            name="aggregate",
        )
        # Only published entries get expire_at, so pending ones never expire.
        yield call(outbox, "create_index", EXPIRE_AT, expireAfterSeconds=0, name="ttl")
        # Entries waiting for the broker, woken at once when it is back.
        yield call(outbox, "create_index", WAITING, sparse=True, name="waiting")
        # Last: entries stored before it existed may hold duplicates, and the others are built.
        try:
            yield call(
                outbox,
                "create_index",
                _SEQUENCE_KEYS,
                unique=True,
                partialFilterExpression=_NUMBERED,
                name=SEQUENCES,
            )
        except DuplicateKeyError as error:
            raise (yield from self._duplicates(error)) from error

    def _duplicates(self, error: DuplicateKeyError) -> Steps[DuplicateSequenceError]:
        """The error for an index build that met entries sharing an aggregate and sequence."""
        pipeline: list[dict[str, Any]] = [
            {"$match": _NUMBERED},
            {
                "$group": {
                    "_id": {
                        "type": "$aggregate_type",
                        "id": "$aggregate_id",
                        "sequence": "$sequence",
                    },
                    "entries": {"$push": "$_id"},
                    "n": {"$sum": 1},
                }
            },
            {"$match": {"n": {"$gt": 1}}},
            {"$sort": {"_id": 1}},
            {"$limit": _SHOWN},
        ]
        found = yield listing(self.outbox, "aggregate", pipeline, allowDiskUse=True)
        if found:
            first = found[0]["_id"]
            named = first["type"], first["id"], first["sequence"]
        else:  # the server named one, but they are gone since (pruned, deleted)
            key = (error.details or {}).get("keyValue") or {}
            named = key.get("aggregate_type"), key.get("aggregate_id"), key.get("sequence")
        shown = "; ".join(
            f"{d['_id']['type']} {d['_id']['id']!r} sequence {d['_id']['sequence']} "
            f"(entries {', '.join(map(str, d['entries']))})"
            for d in found
        )
        more = ", and maybe more" if len(found) == _SHOWN else ""
        return DuplicateSequenceError(
            f"cannot build the unique index {SEQUENCES} of {self.outbox.name}: entries stored "
            f"before it share an aggregate and a sequence: {shown or named}{more}. An aggregate "
            "lost its counters or was created again under its _id. Published entries go after "
            "the outbox's retention; delete the others you do not need, or renumber them, then "
            "ensure the indexes again (the other indexes are built)",
            collection=self.outbox.name,
            aggregate_type=named[0],
            aggregate_id=named[1],
            sequence=named[2],
        )

    def record(self, plan: Plan, session: Any, write: DocumentWrite) -> Steps[Written]:
        return (yield from write(plan, session))

    def insert_entries(
        self, plan: Plan, first: int, existed: bool, now: datetime, session: Any
    ) -> Steps[None]:
        if not plan.events:
            return
        if first == 1 and existed:
            # A document that was there numbers its first events: it never had any, or it lost
            # its counters. (A document the write created is checked by the unique index alone:
            # a create costs no read.)
            yield from self._check_unnumbered(plan, session)
        pending: dict[str, Any] = {STATUS: PENDING, AVAILABLE_AT: now, ATTEMPTS: 0}
        if plan.partition is not None:
            pending[self.partition_field] = plan.partition
        entries = [
            entry | {"sequence": first + i} | pending for i, entry in enumerate(plan.entries)
        ]
        try:
            if len(entries) == 1:  # the cheaper command for the commonest case
                yield call(self.outbox, "insert_one", entries[0], session=session)
            else:
                yield call(self.outbox, "insert_many", entries, session=session)
        except (BulkWriteError, DuplicateKeyError) as error:
            if not _duplicate(error):
                raise
            key = duplicate_key(error, SEQUENCES, (k for k, _ in _SEQUENCE_KEYS))
            if key is not None:
                raise self._reused(plan, key.get("sequence")) from error
            taken = duplicate_id(error)
            raise DuplicateEventError(
                f"event id {taken if taken is not None else '(one of these)'} is already in "
                f"{self.outbox.name} (pending, or published less than retention ago): the "
                "broker would drop one of the two as a duplicate; make a new Event",
                collection=plan.collection.name,
                event_id=taken,
            ) from error

    def _check_unnumbered(self, plan: Plan, session: Any) -> Steps[None]:
        """Refuse numbering an aggregate from 1 while the outbox holds numbered events of it."""
        query = {**plan.stamp, **_NUMBERED}
        held = yield call(
            self.outbox,
            "find_one",
            query,
            {"sequence": 1, "_id": 0},
            sort=[("sequence", -1)],
            session=session,
        )
        if held is not None:
            raise self._reused(plan, held.get("sequence"), last=True)

    def _reused(self, plan: Plan, sequence: Any, *, last: bool = False) -> DuplicateSequenceError:
        held = f"up to sequence {sequence}" if last else f"under sequence {sequence}"
        return DuplicateSequenceError(
            f"{self.outbox.name} already holds events of {plan.collection.name} "
            f"{plan.doc_id!r} {held}, and this write numbers its events from below: consumers "
            "would take them for old ones. Its document lost its _version and _sequence (a "
            "replace without the outbox's fields: an ODM's replace(), or its save of a new "
            "object with a stored _id), or it was deleted and created again. Nothing was "
            "written. Set its _sequence to the highest sequence the outbox holds for it (and "
            "_version above any a client holds), or give a new aggregate a new _id",
            collection=self.outbox.name,
            aggregate_type=plan.stamp["aggregate_type"],
            aggregate_id=plan.stamp["aggregate_id"],
            sequence=sequence,
        )

    def inserted(self, plan: Plan, now: datetime) -> dict[str, Any]:
        return {}

    def guard(self, plan: Plan) -> dict[str, Any]:
        return {}  # a reused event id fails its entry's insert instead

    def operators(self, plan: Plan, now: datetime) -> dict[str, dict[str, Any]]:
        return {}

    def stage(self, plan: Plan, now: datetime) -> dict[str, Any]:
        return {}


def _duplicate(error: BulkWriteError | DuplicateKeyError) -> bool:
    if isinstance(error, DuplicateKeyError):
        return True
    return any(e.get("code") == DUPLICATE_KEY for e in write_errors(error))
