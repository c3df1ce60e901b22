"""Change events as a replica set member sends them, from mongoeco 4.11's bare ones.

mongoeco's events carry an integer ``clusterTime`` (its token), no ``wallTime``, no
``updateDescription``, nothing of the transaction that made them, and a dropped collection is an
``invalidate`` that ends every stream of its database. MongoDB's (Change Events reference):

- ``clusterTime`` is a BSON Timestamp, one per commit: every event of a transaction has its
  commit's, and carries the transaction's ``lsid`` and ``txnNumber``;
- ``wallTime`` is the commit's date;
- an ``update`` says what changed in ``updateDescription`` (``updatedFields``,
  ``removedFields``, ``truncatedArrays``);
- dropping a collection sends ``drop``, renaming it ``rename`` with ``to``; a stream on that
  collection then gets ``invalidate`` and ends, a database's or a deployment's goes on;
- ``disambiguatedPaths`` (to ``showExpandedEvents`` streams) and the document before a write,
  for ``fullDocumentBeforeChange``.

``ChangeEvents`` keeps, per token, the commit it belongs to and its time, and fills
``updateDescription`` from the document before and after the write. Its clock orders as
MongoDB's: an event at ``Timestamp(t, 1)``, where ``t`` is its commit's first token, and "after
everything up to now" at ``Timestamp(t, 2)``; so ``startAtOperationTime`` is inclusive.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bson import Int64, Timestamp

KEEP = 100_000  # tokens remembered; a stream further behind reads plain mongoeco events
DISAMBIGUATED = "disambiguatedPaths"
PRE_IMAGE = "__emulator_pre_image"
RENAMED_TO = "__emulator_renamed_to"
CHANGES_A_DOCUMENT = frozenset({"update", "replace", "delete"})
INVALIDATE_MARK = "i"  # in a resume token's data: it is an invalidate's


@dataclass(frozen=True)
class Commit:
    """The tokens ``first`` to ``last`` of one transaction's commit, and who committed it."""

    first: int
    last: int
    lsid: Any
    txn_number: int


class ChangeEvents:
    """Commits, times and update descriptions of mongoeco's change events, installed on its
    engine and change hub."""

    def __init__(self, engine: Any, hub: Any) -> None:
        self.engine = engine
        self.commits: dict[int, Commit] = {}  # every token of a transaction's commit
        self.walls: dict[int, datetime] = {}
        self.before: dict[tuple[str, str, Any], Any] = {}  # the document an update replaces
        self._patch(engine, hub)

    def _patch(self, engine: Any, hub: Any) -> None:
        update_indexes = engine._update_indexes_locked
        record = engine._record_committed_change
        append = hub._append_committed_event_locked

        def update_indexes_locked(
            db_name: str, coll_name: str, storage_key: Any, document: Any, **options: Any
        ) -> None:
            # An update takes the old document's index entries out first: its pre-image.
            if options.get("action") == "delete" and isinstance(document, Mapping):
                if len(self.before) > KEEP:  # a commit's removals, which record nothing
                    self.before.clear()
                self.before[(db_name, coll_name, _key(document.get("_id")))] = document
            update_indexes(db_name, coll_name, storage_key, document, **options)

        def record_committed_change(context: Any, payload: Any) -> Any:
            operation = payload.get("operation_type") if isinstance(payload, dict) else None
            if operation in CHANGES_A_DOCUMENT:
                key = payload.get("document_key") or {}
                place = (payload["db_name"], payload["coll_name"], _key(key.get("_id")))
                before = self.before.pop(place, None)
                after = payload.get("full_document")
                if isinstance(before, Mapping):
                    # The snapshot has no field of its own for the pre-image: it travels in
                    # update_description, which document() takes apart again.
                    described = describe(before, after) if isinstance(after, Mapping) else {}
                    if operation != "update":
                        described = {}
                    payload["update_description"] = {**described, PRE_IMAGE: dict(before)}
            self.before.clear()
            return record(context, payload)

        def append_committed_event_locked(event: Any) -> None:
            now = datetime.now(UTC)  # BSON dates hold milliseconds
            self.walls[event.token] = now.replace(microsecond=now.microsecond // 1000 * 1000)
            self._forget_old(event.token)
            append(event)

        engine._update_indexes_locked = update_indexes_locked
        engine._record_committed_change = record_committed_change
        hub._append_committed_event_locked = append_committed_event_locked

    def committed(self, first: int, last: int, lsid: Any, txn_number: int) -> None:
        """Tokens ``first`` to ``last`` are one transaction's commit."""
        commit = Commit(first, last, lsid, txn_number)
        for token in range(first, last + 1):
            self.commits[token] = commit

    def _forget_old(self, token: int) -> None:
        for kept in (self.walls, self.commits):
            while len(kept) > KEEP:
                del kept[next(iter(kept))]

    # -- the clock ------------------------------------------------------------------------

    def time_of(self, token: int) -> Timestamp:
        """The clusterTime of the event at ``token``: its commit's."""
        commit = self.commits.get(token)
        return Timestamp(commit.first if commit else token, 1)

    def after(self, token: int) -> Timestamp:
        """A time after the event at ``token`` (and its whole commit), before any later one."""
        return Timestamp(self.time_of(token).time, 2) if token > 0 else Timestamp(0, 1)

    def start_token(self, at: Timestamp) -> int:
        """The first token a stream started at ``at`` sees (inclusive, as MongoDB's)."""
        if at.inc <= 1:
            return at.time
        commit = self.commits.get(at.time)
        return (commit.last if commit else at.time) + 1

    # -- the events -----------------------------------------------------------------------

    def document(self, event: Any) -> tuple[dict[str, Any], Any]:
        """The change event MongoDB sends for mongoeco's ``event``, and the document before
        it (None where there was none, or it was not seen)."""
        document: dict[str, Any] = dict(event.to_document())
        described = document.get("updateDescription")
        before = described.pop(PRE_IMAGE, None) if isinstance(described, dict) else None
        if document.get("operationType") == "rename" and isinstance(described, dict):
            document.pop("documentKey", None)
            document["to"] = described.get(RENAMED_TO)
        if document.get("operationType") != "update":
            document.pop("updateDescription", None)
        token = event.token
        commit = self.commits.get(token)
        document["clusterTime"] = self.time_of(token)
        wall = self.walls.get(commit.first if commit else token)
        if wall is not None:
            document["wallTime"] = wall
        if commit is not None:
            document["lsid"] = commit.lsid
            document["txnNumber"] = Int64(commit.txn_number)
        if document.get("operationType") == "update" and "updateDescription" not in document:
            # Written where no pre-image was seen (mongoeco's own paths): say so honestly.
            document["updateDescription"] = {
                "updatedFields": {},
                "removedFields": [],
                "truncatedArrays": [],
            }
        if document.get("operationType") == "invalidate":
            # mongoeco's drop of a collection: MongoDB's is a drop event.
            document["operationType"] = "drop"
            document.pop("documentKey", None)
        return document, before

    @staticmethod
    def invalidate(event: Any, cluster_time: Timestamp, wall: datetime | None) -> dict[str, Any]:
        """The invalidate that ends a stream after ``event``: its collection's drop or rename."""
        raw = {"v": 1, "t": int(event.token), INVALIDATE_MARK: 1}
        document: dict[str, Any] = {
            "_id": {"_data": _encode(raw)},
            "operationType": "invalidate",
            "clusterTime": cluster_time,
        }
        if wall is not None:
            document["wallTime"] = wall
        return document


def describe(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """``updateDescription`` of the change from ``before`` to ``after``, as MongoDB's diff:
    changed or new fields by dotted path (into subdocuments and array elements), removed
    fields, and arrays made shorter. ``disambiguatedPaths`` (sent to streams with
    ``showExpandedEvents`` only) spells each path whose field names could be read otherwise (a
    name of digits, or with a dot) as its parts, array indices as numbers."""
    updated: dict[str, Any] = {}
    removed: list[str] = []
    truncated: list[dict[str, Any]] = []
    ambiguous: dict[str, list[Any]] = {}

    def note(parts: list[Any]) -> str:
        path = ".".join(str(part) for part in parts)
        if any(isinstance(part, str) and (part.isdigit() or "." in part) for part in parts):
            ambiguous[path] = list(parts)
        return path

    def documents(old: Mapping[str, Any], new: Mapping[str, Any], parts: list[Any]) -> None:
        for name, value in new.items():
            if name not in old:
                updated[note([*parts, name])] = value
            else:
                values(old[name], value, [*parts, name])
        removed.extend(note([*parts, name]) for name in old if name not in new)

    def values(old: Any, new: Any, parts: list[Any]) -> None:
        if _same(old, new):
            return
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            documents(old, new, parts)
        elif isinstance(old, list) and isinstance(new, list):
            if len(new) < len(old):
                truncated.append({"field": note(parts), "newSize": len(new)})
            for index, item in enumerate(new):
                if index >= len(old):
                    updated[note([*parts, index])] = item
                else:
                    values(old[index], item, [*parts, index])
        else:
            updated[note(parts)] = new

    documents(before, after, [])
    description: dict[str, Any] = {
        "updatedFields": updated,
        "removedFields": removed,
        "truncatedArrays": truncated,
    }
    if ambiguous:
        description[DISAMBIGUATED] = ambiguous
    return description


def is_invalidate_token(token: Any) -> bool:
    """Whether a resume token is an invalidate's (a stream cannot resume after one)."""
    data = token.get("_data") if isinstance(token, Mapping) else None
    if not isinstance(data, str):
        return False
    try:
        decoded = json.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
    except ValueError:
        return False
    return isinstance(decoded, dict) and INVALIDATE_MARK in decoded


def _same(old: Any, new: Any) -> bool:
    # 1 and True, or 1 and 1.0, are different BSON values: a write between them changes a field.
    if type(old) is not type(new):
        return False
    if isinstance(old, Mapping):
        return list(old) == list(new) and all(_same(old[k], new[k]) for k in old)
    if isinstance(old, list):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new, strict=True))
    return bool(old == new)


def _key(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return (type(value).__name__, value)


def _encode(raw: dict[str, Any]) -> str:
    data = json.dumps(raw, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(data).decode().rstrip("=")
