"""Why a write with events matched nothing, and the errors that say so.

A conditional write (an ``expected_version``, a filter with guards, the embedded guard against
adding a pending event twice) that matches nothing cannot tell why by itself. A read or two
afterwards does: an event of the write already pending in the document (a write repeated after
it succeeded), a version that moved on, no document matching the filter; or none of these, and
a concurrent write got in first, so the write may be tried again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure

from mongo_outbox._codec import counter
from mongo_outbox._driver import DUPLICATE_KEY
from mongo_outbox._steps import Steps, call
from mongo_outbox._write.plan import Plan
from mongo_outbox.errors import (
    AggregateNotFoundError,
    ConcurrencyError,
    DuplicateEventError,
    InvalidAggregateError,
)


def explain(plan: Plan, session: Any, field: str | None, due_field: str) -> Steps[None]:
    """Raise why ``plan``'s write matched nothing, or return if a retry may succeed. ``field``
    is the embedded entries' array (None in collection mode)."""
    ids = [e.id for e in plan.events]
    if field is not None and ids:
        held = {"$in": ids}
        query = {"_id": plan.doc_id, "$or": [{f"{field}.id": held}, {f"{field}_sent": held}]}
        holder = yield from read(plan, query, session, due_field)
        if holder is not None:
            raise DuplicateEventError(
                f"{plan.collection.name} {plan.doc_id!r} already holds an event of these ids, "
                f"pending or just published: {ids}",
                collection=plan.collection.name,
            )
    found = yield from read(plan, {"_id": plan.doc_id}, session, due_field)
    if not at_version(found, plan.expected_version):
        raise conflict(plan)
    upsert = plan.upsert or (plan.kind == "save" and plan.expected_version is None)
    if found is None:
        if upsert:
            return  # deleted meanwhile: try again
        raise not_found(plan, exists=False)
    if plan.kind in ("update", "delete"):
        matching = yield from read(plan, plan.query, session, due_field)
        if matching is None:
            raise not_found(plan, exists=True)
    # Found, matching, at the expected version: a concurrent write got in first.


def read(plan: Plan, query: dict[str, Any], session: Any, due_field: str) -> Steps[Any]:
    """The counters (and due time) of the document ``query`` matches, or None."""
    projection = {"_version": 1, "_sequence": 1, due_field: 1}
    try:
        return (yield call(plan.collection, "find_one", query, projection, session=session))
    except OperationFailure:  # the refusal aborted the caller's transaction
        return (yield call(plan.collection, "find_one", query, projection))


def at_version(found: Mapping[str, Any] | None, expected: int | None) -> bool:
    """Whether the stored document ``found`` (None: there is none) is at ``expected``."""
    if expected is None:
        return True
    if expected == 0:
        return found is None
    return found is not None and counter(found.get("_version")) == expected


def conflict(plan: Plan) -> ConcurrencyError:
    name = f"{plan.collection.name} {plan.doc_id!r}"
    if plan.expected_version is None:
        # No version was expected: other writers changed the document (or the rest of the
        # filter) between each of this write's reads and its write.
        said = f"{name} changed under this write at each of its tries: write it again"
    else:
        said = f"{name} is not at version {plan.expected_version}" + (
            " (it exists already)" if plan.expected_version == 0 else ""
        )
    return ConcurrencyError(
        said,
        collection=plan.collection.name,
        aggregate_id=plan.doc_id,
        expected_version=plan.expected_version,
    )


def not_found(plan: Plan, exists: bool) -> AggregateNotFoundError:
    why = (
        "a document with that _id exists, but not the rest of the filter"
        if exists
        else "no document has that _id"
    )
    return AggregateNotFoundError(
        f"{plan.collection.name}: nothing matches {plan.query or {'_id': plan.doc_id}!r} ({why})",
        collection=plan.collection.name,
        aggregate_id=plan.doc_id,
        exists=exists,
    )


def too_large(plan: Plan, error: Exception) -> InvalidAggregateError:
    return InvalidAggregateError(
        f"{plan.collection.name} {plan.doc_id!r}: the document with its pending events would be "
        f"too large for MongoDB ({error}); keep the relay running, or save fewer events",
        collection=plan.collection.name,
    )


def on_id(error: DuplicateKeyError) -> bool:
    """Whether the duplicate key is the ``_id``'s (not another unique index of the caller's)."""
    details = error.details or {}
    pattern = details.get("keyPattern")
    if pattern is not None:
        return dict(pattern) == {"_id": 1}
    return " index: _id_ " in str(details.get("errmsg", error))


def write_errors(error: BulkWriteError) -> list[dict[str, Any]]:
    errors: list[dict[str, Any]] = error.details.get("writeErrors", [])
    return errors


def duplicate_key(
    error: BulkWriteError | DuplicateKeyError, index: str, keys: Iterable[str]
) -> dict[str, Any] | None:
    """The key a duplicate-key error found in ``index`` (whose fields are ``keys``): the
    server's ``keyValue``, ``{}`` when it named the index alone; None for another index."""
    details = [error.details or {}] if isinstance(error, DuplicateKeyError) else write_errors(error)
    for detail in details:
        if detail.get("code", DUPLICATE_KEY) != DUPLICATE_KEY:
            continue
        pattern = detail.get("keyPattern")
        if pattern is not None:
            if set(pattern) == set(keys):
                return dict(detail.get("keyValue") or {})
        elif f" index: {index} " in str(detail.get("errmsg", "")):
            return {}
    return None


def duplicate_id(error: BulkWriteError | DuplicateKeyError) -> str | None:
    """The event id (``_id``) a duplicate-key error names, when the server said which (its
    ``keyValue``, or the document an ``insertMany`` failed on)."""
    details = [error.details or {}] if isinstance(error, DuplicateKeyError) else write_errors(error)
    for detail in details:
        for where in ("keyValue", "op"):
            found = (detail.get(where) or {}).get("_id")
            if isinstance(found, str):
                return found
    return None
