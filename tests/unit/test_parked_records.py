"""``ParkedEntry.of``: whatever another producer or a fix by hand stored in a parked entry, its
record is made, never raised on; it is marked unreadable exactly when a field it holds is of
the wrong type, and every field of the right type is kept."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mongo_outbox.admin import ParkedEntry

ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FIELDS = ("type", "aggregate_type", "aggregate_id", "sequence", "version", "attempts")


@given(st.dictionaries(st.sampled_from(FIELDS), ANY), ANY)
def test_any_stored_fields_make_a_record_marked_unreadable_when_one_is_wrong(
    fields: dict[str, Any], event_id: Any
) -> None:
    entry = ParkedEntry.of({"_id": event_id, **fields, "last_error": "why"})
    assert entry.event_id == event_id and entry.last_error == "why"

    def whole(value: Any, low: int) -> bool:
        return type(value) is int and value >= low

    good = (
        isinstance(fields.get("type"), (str, type(None)))
        and isinstance(fields.get("aggregate_type"), (str, type(None)))
        and whole(fields.get("sequence"), 1)
        and ("version" not in fields or whole(fields["version"], 1))
        and (fields.get("attempts") is None or whole(fields["attempts"], -(2**63)))
    )
    assert (entry.unreadable is None) == good, (fields, entry.unreadable)
    if good:
        assert entry.sequence == fields["sequence"] and entry.type == fields.get("type")
        assert entry.version == fields.get("version", 1)
