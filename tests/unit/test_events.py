from __future__ import annotations

import enum
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import bson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field, RootModel

from mongo_outbox import Backoff, Event, InvalidEventError, OutboxError, new_event_id
from mongo_outbox._codec import _DEFAULTS, decode, encode


def test_ids_are_uuid7_unique_and_increasing() -> None:
    ids = [new_event_id() for _ in range(5000)]
    assert all(uuid.UUID(i).version == 7 for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    first_ms = int(uuid.UUID(ids[0]).hex[:12], 16)
    assert abs(first_ms / 1000 - datetime.now(timezone.utc).timestamp()) < 5


@pytest.mark.parametrize(
    "payload",
    [
        {"at": datetime.now(timezone.utc)},
        {"n": float("nan")},
        {"n": float("inf")},
        {"big": 2**63},
        {"$set": 1},
        {"deep": [{"a\x00b": 1}]},
        {"raw": b"bytes"},
        {"set": {1, 2}},
        {1: "non-string key"},
    ],
)
def test_non_json_payload_is_rejected_when_built(payload: object) -> None:
    with pytest.raises(InvalidEventError) as caught:
        Event(type="x", payload=payload)
    assert isinstance(caught.value, OutboxError)


LONE = "a\ud800b"  # a lone surrogate: a Python str, but not Unicode that UTF-8 can carry


@pytest.mark.parametrize(
    "fields",
    [
        {"payload": {"text": LONE}},
        {"payload": {LONE: 1}},
        {"payload": {"deep": [{"k": [LONE]}]}},
        {"type": LONE},
        {"id": LONE},
        {"aggregate_type": LONE},
        {"aggregate_id": LONE},
        {"headers": {"h": LONE}},
        {"headers": {LONE: "v"}},
        {"correlation_id": LONE},
        {"causation_id": LONE},
    ],
)
def test_text_that_is_not_valid_unicode_is_refused_when_built(fields: dict[str, object]) -> None:
    # Refused as broken unicode, or first as a header name no broker can carry.
    with pytest.raises(InvalidEventError, match=r"(?i)unicode|not a token|utf-8|surrogate"):
        Event(**{"type": "x", **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        {"aggregate_id": 2**63},
        {"aggregate_id": -(2**63) - 1},
        {"version": 2**63},
        {"sequence": 2**64},
    ],
)
def test_integers_beyond_64_bits_are_refused_in_every_field(fields: dict[str, object]) -> None:
    with pytest.raises(InvalidEventError, match="64-bit"):
        Event(type="x", **fields)  # type: ignore[arg-type]


def test_any_valid_unicode_is_kept() -> None:
    text = "é 漢字 \U0001f600"
    event = Event(
        type=text, payload={text: text + "\x00"}, headers={"x-text": text}, correlation_id=text
    )
    assert Event.from_json(event.model_dump_json()) == event


def test_json_payload_is_kept_as_given() -> None:
    payload = {"s": "x", "i": -(2**63), "f": 1.5, "b": True, "n": None, "l": [1, {"k": []}]}
    assert Event(type="x", payload=payload).payload == payload


def test_occurred_at_is_utc_to_the_millisecond() -> None:
    local = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=2)))
    event = Event(type="x", occurred_at=local)
    assert event.occurred_at == datetime(2026, 1, 2, 1, 4, 5, 678000, tzinfo=timezone.utc)
    assert Event(type="x").occurred_at.microsecond % 1000 == 0
    with pytest.raises(InvalidEventError):
        Event(type="x", occurred_at=datetime(2026, 1, 1))  # naive: ambiguous


def test_events_are_frozen_and_strict() -> None:
    event = Event(type="x")
    with pytest.raises(Exception):  # noqa: B017, PT011 - pydantic's frozen-instance error
        event.type = "y"  # type: ignore[misc]
    for bad in (
        {"type": ""},
        {"type": "x", "unknown": 1},
        {"type": "x", "version": 0},
        {"type": "x", "sequence": 0},
        {"type": "x", "headers": {"h": 1}},
    ):
        with pytest.raises(InvalidEventError):
            Event(**bad)  # type: ignore[arg-type]


def test_json_round_trip_and_bad_bodies() -> None:
    event = Event(
        type="x",
        payload={"a": [1]},
        aggregate_type="orders",
        aggregate_id=3,
        sequence=2,
        headers={"h": "v"},
        correlation_id="c",
        causation_id="d",
    )
    assert Event.from_json(event.model_dump_json()) == event
    for body in (b"", b"not json", b"{}", b'{"type": "x", "payload": {"n": NaN}}'):
        with pytest.raises(InvalidEventError):
            Event.from_json(body)


def test_backoff_grows_exponentially_with_full_jitter() -> None:
    backoff = Backoff(initial=1, maximum=8)
    for attempt, ceiling in [(1, 1), (2, 2), (3, 4), (4, 8), (10, 8)]:
        delays = [backoff.delay(attempt) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling / 2  # spread over the range, not stuck at zero
    with pytest.raises(ValueError, match="initial"):
        Backoff(initial=0)


class Status(enum.Enum):
    PAID = "paid"


class Line(BaseModel):
    sku: str
    price: Decimal


class OrderPaid(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    order_id: uuid.UUID
    at: datetime
    status: Status
    lines: list[Line]
    total: Decimal = Field(alias="grandTotal")


def order_paid() -> OrderPaid:
    return OrderPaid(
        order_id=uuid.uuid4(),
        at=datetime(2024, 5, 1, 12, 30, tzinfo=timezone.utc),
        status=Status.PAID,
        lines=[Line(sku="book", price=Decimal("9.90"))],
        grandTotal=Decimal("9.90"),
    )


def test_a_model_payload_is_stored_as_its_json_dump_and_validates_back() -> None:
    paid = order_paid()
    event = Event.of(paid, type="order.paid", correlation_id="c-1")
    assert event.type == "order.paid" and event.correlation_id == "c-1"
    assert event.payload == {
        "order_id": str(paid.order_id),
        "at": "2024-05-01T12:30:00Z",
        "status": "paid",
        "lines": [{"sku": "book", "price": "9.90"}],
        "grandTotal": "9.90",
    }
    assert Event(type="order.paid", payload=paid).payload == event.payload
    assert event.payload_as(OrderPaid) == paid
    assert Event.from_json(event.model_dump_json()).payload_as(OrderPaid) == paid


def test_a_payload_that_does_not_fit_the_model_raises_an_invalid_event_error() -> None:
    event = Event(type="order.paid", payload={"order_id": "not a uuid"})
    with pytest.raises(InvalidEventError) as caught:
        event.payload_as(OrderPaid)
    assert caught.value.event_id == event.id and "OrderPaid" in str(caught.value)


def test_model_payloads_obey_the_rules_of_dict_payloads() -> None:
    class Huge(BaseModel):
        n: int

    class Keyed(BaseModel):
        values: dict[str, int]

    for payload in (Huge(n=2**70), Keyed(values={"$set": 1}), RootModel[list[int]]([1, 2])):
        with pytest.raises(InvalidEventError):
            Event(type="x", payload=payload)
    with pytest.raises(InvalidEventError, match="pydantic model"):
        Event.of({"a": 1}, type="x")  # type: ignore[arg-type]


keys = st.from_regex(r"[a-z]{1,4}", fullmatch=True)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)


@given(
    payload=st.dictionaries(keys, json_values, max_size=4),
    # "h-" keeps them clear of the headers brokers act on (CC, Nats-*, x-death, ...).
    headers=st.dictionaries(
        keys.map(lambda key: f"h-{key}"), st.from_regex(r"[a-z0-9]{1,4}", fullmatch=True)
    ),
    sequence=st.none() | st.integers(1, 10**6),
    correlation_id=st.none() | st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True),
)
def test_an_entry_holds_what_model_dump_gives_without_the_defaults(
    payload: dict[str, object],
    headers: dict[str, str],
    sequence: int | None,
    correlation_id: str | None,
) -> None:
    # _codec.encode reads an Event's fields directly instead of calling model_dump(): the same.
    event = Event(
        type="t", payload=payload, headers=headers, sequence=sequence, correlation_id=correlation_id
    )
    dumped = event.model_dump()
    dumped["_id"] = dumped.pop("id")
    expected = {k: v for k, v in dumped.items() if k not in _DEFAULTS or v != _DEFAULTS[k]}
    entry = encode(event, "_id")
    # The same BSON, byte for byte: == alone would take True for 1 and 1.0 for 1.
    assert bson.encode(entry) == bson.encode(expected)
    if sequence is None:  # a stored entry always has one: without, it cannot be put in order
        with pytest.raises(InvalidEventError, match="no sequence"):
            decode(entry, "_id")
    else:
        assert decode(entry, "_id") == event


def test_an_entry_holds_only_the_fields_of_an_event_copied_with_other_keys() -> None:
    # model_copy(update=...) does not validate: keys that are no field stay out of the entry.
    event = Event(type="a").model_copy(update={"foo": 1, "_given": True})
    entry = encode(event, "_id")
    assert "foo" not in entry and "_given" not in entry
    assert entry == encode(Event(**event.model_dump()), "_id")


def test_a_payload_of_a_dict_subclass_is_checked_not_recursed_for_ever() -> None:
    from collections import OrderedDict

    from mongo_outbox.events import _check_json, clean_json

    assert clean_json(OrderedDict(a=1))
    with pytest.raises(ValueError, match="not a JSON number"):
        _check_json(OrderedDict(a=float("nan")), "payload")
