"""How an aggregate document is written, and what a refused write means.

Each write also moves the document's counters: ``_version`` one step, ``_sequence`` one step per
event. It returns both as they are after the write, and the events are numbered from them; and
whether the document was there before it (a write that numbers from 1 a document that was there
lost its counters, or never had events: the layout checks which).

- save, ``expected_version=0``: a plain insert. An existing document, with or without a
  ``_version``, fails it on its ``_id``, and an insert is the cheapest create.
- save otherwise: one ``findAndModify`` whose update pipeline replaces the document's fields and
  keeps its counters (and in embedded mode appends the entries and sets the due time).
- Both ``findAndModify`` writes return the document as it was before them (none: the upsert
  created it), and the counters after are those plus the write's steps.
- update: one ``findAndModify`` with the caller's update and the outbox's part merged in: ``$inc``
  of the counters for operators, a last ``$set`` stage for a pipeline. In embedded mode an
  operator update also ``$push``es the entries, unnumbered (it cannot read the ``_sequence`` it
  moves; ``_codec.numbered`` says why their position tells their number), and ``$max``es the
  due time, so no read precedes the write.
- delete: one ``findAndModify`` that removes the document and returns its counters.
- add (events beside the caller's own writes): one ``findAndModify`` of ``$inc`` alone.

The layout of the outbox's mode (``layout.py``) adds its part to each of these writes: embedded
mode's entries, due time, partition and guards. When a write matches nothing, ``refusals.py``
reads why: an error, or a concurrent write that got in first, and then the write is tried again.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import DocumentTooLarge, DuplicateKeyError, OperationFailure

from mongo_outbox._codec import counter
from mongo_outbox._steps import Steps, call
from mongo_outbox._write.layout import Layout
from mongo_outbox._write.plan import Plan
from mongo_outbox._write.refusals import (
    conflict,
    explain,
    not_found,
    on_id,
    too_large,
)
from mongo_outbox._write.updates import guarded, with_operators
from mongo_outbox.errors import InvalidAggregateError, InvalidCountersError

_TOO_LARGE = frozenset(
    {
        10334,  # BSONObjectTooLarge
        17419,  # the document after the update exceeds the limit
        17420,  # the document to upsert exceeds the limit
    }
)
# The server refused the caller's update for this document: the input's fault, nothing written.
_REFUSED_UPDATE = frozenset(
    {
        2,  # BadValue
        9,  # FailedToParse
        14,  # TypeMismatch
        15,  # Overflow
        16,  # InvalidLength
        28,  # PathNotViable
        40,  # ConflictingUpdateOperators
        52,  # DollarPrefixedFieldName
        54,  # NotSingleValueField
        55,  # InvalidDBRef
        56,  # EmptyFieldName
        57,  # DottedFieldName
        66,  # ImmutableField
        168,  # InvalidPipelineOperator: an unknown expression operator
        241,  # ConversionFailure
        16410,  # a field path starting with "$"
        16554,  # $add of a value that is not a number or date
        16555,  # $multiply of a value that is not a number
        16556,  # $subtract of values that do not subtract
        16702,  # $concat of a value that is not a string
        17276,  # an undefined $$variable
        28664,  # $concatArrays of a value that is no array: a stored outbox field of another type
        40324,  # an unknown pipeline stage
    }
)
_ATTEMPTS = 3  # a write that a concurrent one keeps overtaking ends in ConcurrencyError

Counted = tuple[int, int, bool]
"""A write's ``_version`` and ``_sequence`` after it, and whether the document was there before."""
_COUNTERS = {"_version": 1, "_sequence": 1}


class DocumentWriter:
    """Writes aggregate documents, with ``layout``'s part in each write."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def write(self, plan: Plan, session: Any, now: datetime) -> Steps[Counted]:
        """Write the document; return its new ``_version`` and ``_sequence``, and whether it
        was there before."""
        try:
            if plan.kind == "save" and plan.expected_version == 0:
                return (yield from self._insert(plan, session, now))
            if plan.kind == "delete":
                return (yield from self._delete(plan, session))
            return (yield from self._update(plan, session, now))
        except DocumentTooLarge as error:
            raise too_large(plan, error) from error
        except OperationFailure as error:
            if error.code in _TOO_LARGE:
                raise too_large(plan, error) from error
            transient = error.has_error_label("TransientTransactionError")
            if error.code in _REFUSED_UPDATE and not transient:
                # An update's own content, or for any write counters it cannot add to.
                raise InvalidAggregateError(
                    f"MongoDB refused the {plan.kind} of {plan.collection.name} {plan.doc_id!r}: "
                    f"{error.details.get('errmsg') if error.details else error} "
                    f"(code {error.code})",
                    collection=plan.collection.name,
                ) from error
            raise

    def _insert(self, plan: Plan, session: Any, now: datetime) -> Steps[Counted]:
        n = len(plan.events)
        document = plan.body | {"_version": 1, "_sequence": n} | self.layout.inserted(plan, now)
        try:
            yield call(plan.collection, "insert_one", document, session=session)
        except DuplicateKeyError as error:
            if not on_id(error):
                raise
            raise conflict(plan) from error
        return 1, n, False

    def _update(self, plan: Plan, session: Any, now: datetime) -> Steps[Counted]:
        for _ in range(_ATTEMPTS):
            written = yield from self._write_blind(plan, session, now)
            if written is not None:
                return written
            yield from explain(plan, session, self.layout.entries_field, self.layout.due_field)
        raise conflict(plan)

    def _write_blind(self, plan: Plan, session: Any, now: datetime) -> Steps[Counted | None]:
        """One write that moves the counters where they are: no need to read them first."""
        conditions = _version_guard(plan.expected_version) | self.layout.guard(plan)
        if plan.kind == "save":
            # Replace the fields, keep the counters (and the embedded fields): one stage.
            sets = self._counted(plan, now)
            update: Any = [{"$replaceWith": {"$mergeObjects": [{"$literal": plan.body}, sets]}}]
            query, upsert = {"_id": plan.doc_id}, plan.expected_version is None
        elif isinstance(plan.update, dict):
            ours: dict[str, dict[str, Any]] = {
                "$inc": {"_version": 1, "_sequence": len(plan.events)}
            }
            ours |= self.layout.operators(plan, now)
            update = with_operators(plan.update, ours)
            query, upsert = plan.query, plan.upsert
        else:
            update = [*(plan.update or []), {"$set": self._counted(plan, now)}]
            query, upsert = plan.query, plan.upsert
        return (
            yield from self._find_and_modify(
                plan, guarded(query, conditions), update, upsert, session
            )
        )

    def _counted(self, plan: Plan, now: datetime) -> dict[str, Any]:
        """The ``$set`` stage that moves the counters (and the layout's part: embedded entries)."""
        n = len(plan.events)
        sets: dict[str, Any] = {
            "_version": {"$add": [{"$ifNull": ["$_version", 0]}, 1]},
            "_sequence": {"$add": [{"$ifNull": ["$_sequence", 0]}, n]},
        }
        sets |= self.layout.stage(plan, now)
        return sets

    def _find_and_modify(
        self, plan: Plan, query: dict[str, Any], update: Any, upsert: bool, session: Any
    ) -> Steps[Counted | None]:
        # Only an update of operators has array filters (the caller's $[identifier]s).
        extra = {"array_filters": plan.array_filters} if plan.array_filters is not None else {}
        try:
            # The document before the write: none when the upsert created it, which the
            # document after it would not tell from one that was there without counters.
            stored = yield call(
                plan.collection,
                "find_one_and_update",
                query,
                update,
                upsert=upsert,
                projection=_COUNTERS,
                return_document=ReturnDocument.BEFORE,
                session=session,
                **extra,
            )
        except DuplicateKeyError as error:
            if not on_id(error):
                raise
            # The upsert matched nothing and its insert hit the document that is there.
            return None
        if stored is None:
            return (1, len(plan.events), False) if upsert else None
        in_document = self.layout.entries_field is not None
        return (*_counters(plan, stored, session, moved=True, in_document=in_document), True)

    def _delete(self, plan: Plan, session: Any) -> Steps[Counted]:
        query = guarded(plan.query, _version_guard(plan.expected_version))
        for _ in range(_ATTEMPTS):
            removed = yield call(
                plan.collection, "find_one_and_delete", query, projection=_COUNTERS, session=session
            )
            if removed is not None:
                return (*_counters(plan, removed, session, moved=True), True)
            yield from explain(plan, session, self.layout.entries_field, self.layout.due_field)
        raise conflict(plan)


def bump(plan: Plan, session: Any) -> Steps[Counted]:
    """add_events: move the counters of a document the caller wrote in its own transaction."""
    stored = yield call(
        plan.collection,
        "find_one_and_update",
        {"_id": plan.doc_id},
        {"$inc": {"_version": 1, "_sequence": len(plan.events)}},
        projection=_COUNTERS,
        return_document=ReturnDocument.AFTER,
        session=session,
    )
    if stored is None:
        raise not_found(plan, exists=False)
    return (*_counters(plan, stored, session), True)


def _counters(
    plan: Plan,
    stored: dict[str, Any],
    session: Any,
    *,
    moved: bool = False,
    in_document: bool = False,
) -> tuple[int, int]:
    """The document's ``_version`` and ``_sequence`` after the write, as ints; ``moved``: the
    write did not move them (a delete returns the document before it), so move them here;
    ``in_document``: the events went in with the write (embedded mode)."""
    raw = stored.get("_version"), stored.get("_sequence")
    # A missing or null counter counts as 0, as $inc and the pipeline's $ifNull do.
    version, sequence = (0 if value is None else counter(value) for value in raw)
    n = len(plan.events)
    if version is not None and sequence is not None:
        # Both the counters before the write and those after it must be in range: a negative
        # one before it would number events from 0 or below.
        before, after = ((version, sequence), (version + 1, sequence + n))
        if not moved:
            before, after = ((version - 1, sequence - n), (version, sequence))
        if all(counter(value) is not None for value in (*before, *after)):
            return after
    in_transaction = session is not None and session.in_transaction
    if not in_document:
        what = (
            "Its events were not recorded: the transaction must not commit (one the outbox "
            "began is aborted)"
        )
    elif in_transaction:
        what = "This write, with its events, is in the transaction: it commits or aborts with it"
    else:
        what = "This write is stored, with its events"
    raise InvalidCountersError(
        f"{plan.collection.name} {plan.doc_id!r} holds _version {raw[0]!r} and _sequence "
        f"{raw[1]!r}: the outbox counts them with whole numbers from 0 to 2**63 - 1 (did other "
        "code write them?). " + what,
        collection=plan.collection.name,
        aggregate_id=plan.doc_id,
        stored=in_document and not in_transaction,
    )


def _version_guard(expected: int | None) -> dict[str, Any]:
    if expected is None:
        return {}
    # 0 (must not exist yet) matches no document, so an upsert must insert: an existing
    # document, even one without _version, fails that insert on its _id.
    return {"_version": expected if expected else {"$lt": 0}}
