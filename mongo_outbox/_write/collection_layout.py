"""Collection mode's layout: each event is a document of the outbox collection, its ``_id`` the
event id, inserted in the same multi-document transaction as the aggregate document. A reused
event id fails that insert, so no registry is needed; the aggregate document holds its counters
only.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pymongo.errors import BulkWriteError, DuplicateKeyError

from mongo_outbox._driver import DUPLICATE_KEY
from mongo_outbox._write.aggregates import check_size
from mongo_outbox._write.layout import COUNTERS, DocumentWrite, encoded
from mongo_outbox._write.plan import Kind, Plan, Written
from mongo_outbox._write.refusals import duplicate_id, write_errors
from mongo_outbox._write.steps import Steps, call
from mongo_outbox.errors import DuplicateEventError
from mongo_outbox.events import Event


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
                [("partition", 1), ("status", 1), ("available_at", 1)],
                name="relay_partition_due",
            )
        yield call(outbox, "create_index", [("status", 1), ("available_at", 1)], name="relay_due")
        yield call(
            outbox,
            "create_index",
            [("aggregate_type", 1), ("aggregate_id", 1), ("sequence", 1)],
            name="aggregate",
        )
        # Only published entries get expire_at, so pending ones never expire.
        yield call(outbox, "create_index", "expire_at", expireAfterSeconds=0, name="ttl")
        # Entries waiting for the broker, woken at once when it is back.
        yield call(outbox, "create_index", "waiting", sparse=True, name="waiting")

    def record(self, plan: Plan, session: Any, write: DocumentWrite) -> Steps[Written]:
        return (yield from write(plan, session))

    def insert_entries(self, plan: Plan, first: int, now: datetime, session: Any) -> Steps[None]:
        if not plan.events:
            return
        pending: dict[str, Any] = {"status": "pending", "available_at": now, "attempts": 0}
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
            taken = duplicate_id(error)
            raise DuplicateEventError(
                f"event id {taken if taken is not None else '(one of these)'} is already in "
                f"{self.outbox.name} (pending, or published less than retention ago): the "
                "broker would drop one of the two as a duplicate; make a new Event",
                collection=plan.collection.name,
                event_id=taken,
            ) from error

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
