"""How an Event is stored as an outbox entry and read back (``_codec.py``): the write side and
the relay agree, in both modes, for any event; what an entry cannot hold is refused at the
write, and an entry this version cannot read is an ``InvalidEventError`` the relay parks."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import bson
import pytest
from bson.codec_options import CodecOptions
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from hypothesis import given
from hypothesis import strategies as st
from pydantic import computed_field

from mongo_outbox import Event
from mongo_outbox._codec import counter, decode, encode, numbered, shown
from mongo_outbox.errors import InvalidEventError
from mongo_outbox.events import MAX_PAYLOAD_DEPTH

ID_KEYS = st.sampled_from(["_id", "id"])
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8)
KEY = TEXT.filter(lambda key: not key.startswith("$"))  # MongoDB stores no $-key
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEY, inner, max_size=3),
    max_leaves=8,
)
IDENTITY = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9.:-]{0,15}", fullmatch=True)
HEADERS = st.dictionaries(
    st.from_regex(r"app-[a-z]{1,8}", fullmatch=True),
    st.from_regex(r"[!-~]([ -~]{0,10}[!-~])?", fullmatch=True),
)
EVENTS = st.builds(
    Event,
    id=IDENTITY,
    type=st.text(min_size=1, max_size=20),
    payload=st.dictionaries(KEY, JSON, max_size=4),
    aggregate_type=st.none() | st.text(min_size=1, max_size=10),
    aggregate_id=st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(min_size=1, max_size=10),
    sequence=st.integers(1, 2**63 - 1),
    occurred_at=st.datetimes(
        min_value=datetime(1970, 1, 1),
        max_value=datetime(9000, 1, 1),
        timezones=st.just(timezone.utc),
    ),
    headers=HEADERS,
    correlation_id=st.none() | IDENTITY,
    causation_id=st.none() | IDENTITY,
    version=st.integers(1, 50),
)


def stored(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` through BSON, as the relay reads it from the database (aware UTC dates)."""
    options: CodecOptions[dict[str, Any]] = CodecOptions(tz_aware=True)
    return bson.decode(bson.encode(entry), codec_options=options)


@given(event=EVENTS, id_key=ID_KEYS)
def test_any_event_stored_as_an_entry_reads_back_as_the_same_event(
    event: Event, id_key: str
) -> None:
    assert decode(stored(encode(event, id_key)), id_key) == event


@given(event=EVENTS, id_key=ID_KEYS)
def test_an_entry_leaves_out_the_optional_fields_that_hold_their_default(
    event: Event, id_key: str
) -> None:
    entry = encode(event, id_key)
    assert entry[id_key] == event.id and ("id" not in entry or id_key == "id")
    for name in ("headers", "correlation_id", "causation_id"):
        assert (name in entry) == (getattr(event, name) not in (None, {}))
    # A listing shows every field, defaults included.
    assert shown(entry).keys() >= {"headers", "correlation_id", "causation_id", "sequence"}


def test_the_relays_bookkeeping_fields_are_ignored_when_an_entry_is_read() -> None:
    event = Event(type="placed", sequence=1)
    entry = encode(event, "_id") | {"_due": datetime.now(timezone.utc), "attempts": 3}
    assert decode(entry, "_id") == event


def test_a_naive_date_from_a_client_without_tz_aware_reads_as_utc() -> None:
    event = Event(type="placed", sequence=1)
    entry = encode(event, "_id")
    entry["occurred_at"] = event.occurred_at.replace(tzinfo=None)
    assert decode(entry, "_id").occurred_at == event.occurred_at


@pytest.mark.parametrize("sequence", [None, 0, -1, 1.5, "1"])
def test_an_entry_without_a_whole_sequence_from_1_cannot_be_put_in_order(sequence: Any) -> None:
    entry = encode(Event(type="placed"), "_id") | {"sequence": sequence}
    with pytest.raises(InvalidEventError, match="no sequence to publish it in order by"):
        decode(entry, "_id")


def test_an_entry_of_another_producer_is_an_invalid_event_carrying_its_id() -> None:
    entry = {"_id": "e1", "sequence": 1, "payload": {"a": 1}, "occurred_at": "yesterday"}
    with pytest.raises(InvalidEventError, match="outbox entry 'e1' cannot be read") as raised:
        decode(entry, "_id")
    assert raised.value.event_id == "e1"


class Computed(Event):
    @computed_field  # type: ignore[prop-decorator]
    @property
    def total(self) -> int:
        return 3


def test_an_event_subclass_that_dumps_more_than_an_event_is_refused() -> None:
    with pytest.raises(InvalidEventError, match=r"dumps \['total'\] beside or instead"):
        encode(Computed(type="x"), "_id")


@given(st.integers(0, 2**63 - 1))
def test_a_counter_reads_the_same_from_an_int_an_int64_and_a_decimal128(value: int) -> None:
    assert counter(value) == counter(Int64(value)) == counter(Decimal128(str(value))) == value
    if value < 2**53:
        assert counter(float(value)) == value


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        -1,
        2**63,
        0.5,
        float(2**53),
        float("nan"),
        Decimal("1.5"),
        Decimal128("Infinity"),
        "1",
    ],
)
def test_a_counter_that_is_no_whole_number_in_range_reads_as_none(value: Any) -> None:
    assert counter(value) is None


def test_unnumbered_embedded_entries_take_their_number_from_their_place_before_the_end() -> None:
    entries = [{"id": "a", "sequence": 4}, {"id": "b"}, {"id": "c", "sequence": None}, "junk"]
    assert numbered(entries, Int64(7)) == [
        {"id": "a", "sequence": 4},
        {"id": "b", "sequence": 5},
        {"id": "c", "sequence": 6},
        "junk",
    ]
    # Without a readable _sequence the entries stay as they are (and fail to decode).
    assert numbered(entries, "7") == entries


def test_an_entry_keeps_millisecond_dates_as_mongodb_stores_them() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, 678_000, tzinfo=timezone.utc)
    event = Event(type="x", sequence=1, occurred_at=at + timedelta(microseconds=999))
    assert decode(stored(encode(event, "id")), "id").occurred_at == at


# Payload values another producer or a hand edit may leave in an entry: of JSON's types or not
# (bson's Int64, dates, ObjectIds), and ones the Event's payload rules refuse (NaN, $-keys,
# lone surrogates, ints past 64 bits): decoding takes a shortcut for plain payloads only.
ODD = (
    JSON
    | st.floats()
    | st.integers()
    | st.builds(Int64, st.integers(-(2**63), 2**63 - 1))
    | st.datetimes(timezones=st.just(timezone.utc))
    | st.builds(bson.ObjectId)
    | st.text(max_size=4)
)
ODD_PAYLOADS = st.recursive(
    ODD,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
).filter(lambda value: isinstance(value, dict)) | st.dictionaries(st.text(max_size=4), ODD)


def wholly_validated(entry: dict[str, Any], id_key: str) -> Event:
    """The Event an entry holds by pydantic's whole validation, the reference for ``decode``."""
    data = {k: v for k, v in entry.items() if k in Event.model_fields}
    data["id"] = entry[id_key]
    data["occurred_at"] = data["occurred_at"].astimezone(timezone.utc)
    return Event.model_validate(data)


@given(event=EVENTS, payload=ODD_PAYLOADS)
def test_an_entry_reads_as_whole_validation_reads_it_whatever_its_payload(
    event: Event, payload: dict[str, Any]
) -> None:
    entry = encode(event, "_id") | {"payload": payload}
    try:
        expected = wholly_validated(entry, "_id")
    except (ValueError, TypeError):
        with pytest.raises(InvalidEventError, match="cannot be read"):
            decode(entry, "_id")
        return
    decoded = decode(entry, "_id")
    assert decoded == expected and type(decoded) is Event
    # What is sent is the same too: the JSON of the one is the JSON of the other.
    assert decoded.model_dump_json() == expected.model_dump_json()


def test_a_payload_nested_deeper_than_an_event_may_is_refused_when_read() -> None:
    deep: dict[str, Any] = {}
    for _ in range(MAX_PAYLOAD_DEPTH + 1):
        deep = {"a": deep}
    entry = encode(Event(type="placed", sequence=1), "_id") | {"payload": deep}
    with pytest.raises(InvalidEventError, match="nested deeper"):
        decode(entry, "_id")
    shallower = deep["a"]
    assert decode(entry | {"payload": shallower}, "_id").payload == shallower


@pytest.mark.parametrize("leaf", [1, "x", [], None])
def test_a_list_at_the_depth_limit_holds_nothing_when_read(leaf: Any) -> None:
    # clean_json looks at a list's ints and strs in place: the depth limit holds for them too.
    def payload(levels: int) -> dict[str, Any]:
        inner: list[Any] = [leaf]
        for _ in range(levels - 2):
            inner = [inner]
        return {"a": inner}

    entry = encode(Event(type="placed", sequence=1), "_id")
    at_limit = payload(MAX_PAYLOAD_DEPTH + 1)  # the leaf one level too deep
    with pytest.raises(InvalidEventError, match="nested deeper"):
        decode(entry | {"payload": at_limit}, "_id")
    assert decode(entry | {"payload": payload(MAX_PAYLOAD_DEPTH)}, "_id").payload
