"""An ``$in`` list prepared once per command, not once per document (mongoeco 4.11).

mongoeco turns an ``$in``'s values into a lookup set (each value typed and hashed) every time it
matches a document against it, and an update recompiles its filter for every document it
changes, so ``update_many({"_id": {"$in": ids}})`` cost O(len(ids) ** 2): 1.4 s for the 800 ids
of one relay's settle on a quiet machine, 9 s under load. One such command holds the emulator's
only thread, and no lease renewal got through behind it: a relay gave its lease up in
``tests/integration/relay/test_changestream.py``'s crash test. A replica set finds each id in its
``_id`` index. Here the last list's lookup set is kept for the next match of an equal list of
plain values (strings, ObjectIds, numbers: every id the library writes).
"""

from __future__ import annotations

from typing import Any

from bson import ObjectId
from mongoeco.core._filtering_matching import FilteringMatchingMixin

_PREPARE = "_prepare_membership_values"
# Equal as BSON values only when equal with their types: True == 1 and 1 == 1.0 in Python, and
# a list of those must not take another's lookup set.
_PLAIN = frozenset({str, int, float, ObjectId})


def _key(values: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if all(type(value) in _PLAIN for value in values):
        return tuple((type(value), value) for value in values)
    return None


def install() -> None:
    """Keep the last ``$in`` list's prepared values, for every match in this process."""
    prepare = getattr(FilteringMatchingMixin, _PREPARE)
    if getattr(prepare, "memoized", False):
        return
    last: list[Any] = [None]  # (key, null_matches_undefined, collation, prepared)

    def prepared(
        cls: Any, values: tuple[Any, ...], *, null_matches_undefined: bool, collation: Any = None
    ) -> Any:
        key = _key(values)
        kept = last[0]
        if (
            key is not None
            and kept is not None
            and kept[0] == key
            and kept[1] == null_matches_undefined
            and kept[2] is collation
        ):
            return kept[3]
        result = prepare.__func__(
            cls, values, null_matches_undefined=null_matches_undefined, collation=collation
        )
        if key is not None:
            last[0] = (key, null_matches_undefined, collation, result)
        return result

    prepared.memoized = True  # type: ignore[attr-defined]
    setattr(FilteringMatchingMixin, _PREPARE, classmethod(prepared))
