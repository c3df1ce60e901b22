"""A body from a newer producer: top-level fields this version of Event does not know are
ignored when a consumer reads it (``Event.from_json``), so a rolling upgrade of producers never
strands a consumer; building an Event, the write side, still refuses them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mongo_outbox import Event, InvalidEventError
from tests.unit.test_entry_codec import EVENTS, JSON

UNKNOWN = st.text(max_size=12).filter(lambda key: key not in Event.model_fields)
EXTRAS = st.dictionaries(UNKNOWN, JSON, min_size=1, max_size=4)


def body(event: Event, before: dict[str, Any], after: dict[str, Any]) -> bytes:
    """The event as JSON with unknown fields before and after its own."""
    return json.dumps(before | event.model_dump(mode="json") | after).encode()


@given(event=EVENTS, before=EXTRAS, after=st.dictionaries(UNKNOWN, JSON, max_size=2))
def test_any_event_with_unknown_fields_beside_its_own_reads_as_the_event(
    event: Event, before: dict[str, Any], after: dict[str, Any]
) -> None:
    assert Event.from_json(body(event, before, after)) == event


def test_a_body_with_unknown_fields_is_still_refused_for_a_known_field_it_gets_wrong() -> None:
    # Ignoring what it does not know is no licence to read what it knows wrongly.
    sent = json.dumps({"type": "x", "sequence": 0, "schema": "v9"})
    with pytest.raises(InvalidEventError, match="sequence") as refused:
        Event.from_json(sent)
    assert "schema" not in str(refused.value)
    for bad in (b"[1]", b'{"schema": "v9"}', b'{"type": "x", "a": 1'):
        with pytest.raises(InvalidEventError, match="is not an Event"):
            Event.from_json(bad)


def test_building_an_event_with_an_unknown_field_is_still_refused() -> None:
    # The write side: a producer's typo fails before anything is written.
    with pytest.raises(InvalidEventError, match="tpye"):
        Event(type="x", tpye="y")  # type: ignore[call-arg]
