"""``_id`` lookups by key, not by a scan of the collection (mongoeco 4.11).

mongoeco keys its documents by a typed ``_id`` (``1`` and ``1.0`` are two keys), so to honour
BSON equality (``1 == 1.0 == Int64(1)``) it scans the whole collection whenever an ``_id`` holds
a number, and at every single-document insert whatever the ``_id``: each write cost O(collection
size). A replica set finds the document through its ``_id`` index. Here scalar numbers (int,
Int64, a finite float) are keyed by their value, so equal numbers are one key as in BSON, and
the scan is left to the ``_id``\\ s that need it: a Decimal128, a NaN, or a number inside a
document or array, and, once such an ``_id`` was stored, to every numeric one.

mongoeco also scans for an ``_id`` that is not stored (an update or upsert of a new document)
and for every ``_id: {$in: [...]}``, such as the relay's claim and settle of a batch by their ids:
on the emulator the claim cost O(outbox size), 10 ms of a 12 ms commit-to-broker latency with
200 entries kept (benchmarks/bench_latency_defaults.py). Where every value is keyed as above
(a string, an ObjectId, a scalar number), the candidates are those keys' documents, in natural
order; mongoeco still matches each against the whole filter.
"""

from __future__ import annotations

import math
from typing import Any

import mongoeco.engines.memory as memory
from bson import ObjectId
from mongoeco.core.query_plan import AndCondition, EqualsCondition, InCondition
from mongoeco.engines._memory_collection import MemoryCollection


def _scalar_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return not (isinstance(value, float) and not math.isfinite(value))


def install(engine: Any) -> None:
    """Key ``engine``'s ``_id``\\ s this way (before it holds any document)."""
    typed_key = engine._storage_key
    contains_number = memory.id_contains_numeric_value  # type: ignore[attr-defined]
    ensure_unique = engine._ensure_unique_indexes
    other_numbers = [False]  # an _id only a scan can compare was keyed

    def storage_key(value: Any) -> Any:
        if _scalar_number(value):
            # 1 == 1.0 == Int64(1) in Python too, with one hash: one dict key per BSON number.
            return ("number", value)
        if not other_numbers[0] and contains_number(value):
            other_numbers[0] = True
        return typed_key(value)

    def needs_scan(value: Any) -> bool:
        if _scalar_number(value) and not other_numbers[0]:
            return False
        return bool(contains_number(value))

    def ensure_unique_indexes(db_name: str, coll_name: str, candidate: Any, **options: Any) -> None:
        if "_id" in candidate and not needs_scan(candidate["_id"]):
            options["scan_payload_id"] = False  # the _id's key says all a scan would
        ensure_unique(db_name, coll_name, candidate, **options)

    def keyed(value: Any) -> bool:
        """Whether the documents whose ``_id`` equals ``value`` are the one of its key."""
        if isinstance(value, (str, ObjectId)):
            return True
        return _scalar_number(value) and not other_numbers[0]

    def ids_of(plan: Any) -> tuple[Any, ...] | None:
        """The ``_id``\\ s a filter is limited to, when all are keyed; else None."""
        clauses = plan.clauses if isinstance(plan, AndCondition) else (plan,)
        for clause in clauses:
            values: tuple[Any, ...]
            if isinstance(clause, EqualsCondition):
                values = (clause.value,)
            elif isinstance(clause, InCondition):
                values = clause.values
            else:
                continue
            if (
                clause.field == "_id"
                and not clause.null_matches_undefined
                and all(map(keyed, values))
            ):
                return values
        return None

    def candidate_items(coll: Any, query_plan: Any, **options: Any) -> list[tuple[Any, Any]]:
        ids = ids_of(query_plan)
        if (
            ids is None
            or options.get("collation") is not None
            or not isinstance(coll, MemoryCollection)
        ):
            return list(candidates(coll, query_plan, **options))
        keys = coll.ordered_keys({storage_key(value) for value in ids})
        return [(key, coll[key]) for key in keys]

    candidates = engine._candidate_items_for_plan_locked
    engine._storage_key = storage_key
    engine._ensure_unique_indexes = ensure_unique_indexes
    engine._candidate_items_for_plan_locked = candidate_items
    memory.id_contains_numeric_value = needs_scan  # type: ignore[attr-defined]
