"""How an aggregate document is written, and what a refused write means.

A document that must not exist yet (``expected_version=0``) is created with a plain insert: an
existing document, with or without a ``_version``, fails it on its ``_id``, and an insert is the
cheapest create. Any other save is one ``findAndModify`` whose update pipeline replaces the
document's fields and keeps its counters: ``_version`` (one step per save) and ``_sequence`` (one
step per event). In embedded mode the same write appends the entries and sets the due time.

When the update matches nothing, one read tells why: an event of the save is already pending in
the document (a save repeated after it succeeded), or the version moved on.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import BulkWriteError, DocumentTooLarge, DuplicateKeyError, OperationFailure

from mongo_outbox._codec import encode
from mongo_outbox.errors import ConcurrencyError, DuplicateEventError, InvalidAggregateError
from mongo_outbox.events import Event

_TOO_LARGE = frozenset(
    {
        10334,  # BSONObjectTooLarge
        17419,  # the document after the update exceeds the limit
        17420,  # the document to upsert exceeds the limit
    }
)


class DocumentWriter:
    """Writes aggregate documents for an outbox of ``mode`` whose entries live in ``field``."""

    def __init__(self, mode: str, field: str, due_field: str, claim_field: str, wait_field: str):
        self.mode = mode
        self.field = field
        self.due_field = due_field
        self.claim_field = claim_field
        self.wait_field = wait_field

    async def write(self, plan: Plan, session: Any, now: datetime) -> tuple[int, int]:
        """Write the document; return its new ``_version`` and ``_sequence``."""
        try:
            if plan.expected_version == 0:
                return await self._insert(plan, session, now)
            return await self._update(plan, session, now)
        except DocumentTooLarge as error:
            raise _too_large(plan, error) from error
        except OperationFailure as error:
            if error.code in _TOO_LARGE:
                raise _too_large(plan, error) from error
            raise

    async def _insert(self, plan: Plan, session: Any, now: datetime) -> tuple[int, int]:
        n = len(plan.events)
        document = plan.body | {"_version": 1, "_sequence": n}
        if self.mode == "embedded":
            document[self.field] = [
                encode(e, "id") | {"sequence": i} for i, e in enumerate(plan.events, start=1)
            ]
            if n:
                document[self.due_field] = now
        try:
            await plan.collection.insert_one(document, session=session)
        except DuplicateKeyError as error:
            if not _on_id(error):
                raise
            raise _conflict(plan) from error
        return 1, n

    async def _update(self, plan: Plan, session: Any, now: datetime) -> tuple[int, int]:
        n = len(plan.events)
        sets: dict[str, Any] = {
            "_version": {"$add": [{"$ifNull": ["$_version", 0]}, 1]},
            "_sequence": {"$add": [{"$ifNull": ["$_sequence", 0]}, n]},
        }
        query: dict[str, Any] = {"_id": plan.doc_id}
        if plan.expected_version is not None:
            query["_version"] = plan.expected_version
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
            # The relay's own fields survive a save: $replaceWith would drop them otherwise.
            sets[self.claim_field] = f"${self.claim_field}"
            sets[self.wait_field] = f"${self.wait_field}"
            if n:
                # A retried save whose events are already pending here must not add them twice.
                query[f"{self.field}.id"] = {"$nin": [e.id for e in plan.events]}
        pipeline = [{"$replaceWith": {"$mergeObjects": [{"$literal": plan.body}, sets]}}]
        for _ in range(2):
            try:
                stored = await plan.collection.find_one_and_update(
                    query,
                    pipeline,
                    upsert=plan.expected_version is None,
                    projection={"_version": 1, "_sequence": 1},
                    return_document=ReturnDocument.AFTER,
                    session=session,
                )
            except DuplicateKeyError as error:
                if not _on_id(error):
                    raise
                # The upsert matched nothing and its insert hit the document that is there.
                stored = None
            if stored is not None:
                return stored["_version"], stored["_sequence"]
            await self._refusal(plan, session)
        raise _conflict(plan)

    async def _refusal(self, plan: Plan, session: Any) -> None:
        """Why the update matched nothing: raise it, or return if a retry may succeed."""
        ids = [e.id for e in plan.events]
        query = {"_id": plan.doc_id, f"{self.field}.id": {"$in": ids}}
        if self.mode == "embedded" and ids:
            try:
                holder = await plan.collection.find_one(query, {"_id": 1}, session=session)
            except OperationFailure:  # the refusal aborted the caller's transaction
                holder = await plan.collection.find_one(query, {"_id": 1})
            if holder is not None:
                raise DuplicateEventError(
                    f"{plan.collection.name} {plan.doc_id!r} already holds a pending event of "
                    f"these ids: {ids}",
                    collection=plan.collection.name,
                )
        if plan.expected_version is not None:
            raise _conflict(plan)
        # No expected version: a concurrent save created the document meanwhile; try again.


@dataclass(frozen=True)
class Plan:
    """One save, checked: what to write where, and the version it expects."""

    collection: Any
    body: dict[str, Any]
    doc_id: Any
    events: list[Event]
    expected_version: int | None


def _conflict(plan: Plan) -> ConcurrencyError:
    return ConcurrencyError(
        f"{plan.collection.name} {plan.doc_id!r} is not at version {plan.expected_version}"
        + (" (it exists already)" if plan.expected_version == 0 else ""),
        collection=plan.collection.name,
        aggregate_id=plan.doc_id,
        expected_version=plan.expected_version or 0,
    )


def _too_large(plan: Plan, error: Exception) -> InvalidAggregateError:
    return InvalidAggregateError(
        f"{plan.collection.name} {plan.doc_id!r}: the document with its pending events would be "
        f"too large for MongoDB ({error}); keep the relay running, or save fewer events",
        collection=plan.collection.name,
    )


def _on_id(error: DuplicateKeyError) -> bool:
    details = error.details or {}
    pattern = details.get("keyPattern")
    if pattern is not None:
        return dict(pattern) == {"_id": 1}
    return " index: _id_ " in str(details.get("errmsg", error))


def write_errors(error: BulkWriteError) -> list[dict[str, Any]]:
    errors: list[dict[str, Any]] = error.details.get("writeErrors", [])
    return errors
