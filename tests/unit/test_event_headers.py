"""What every broker can carry is checked when an Event is built: header names and values, the
headers the brokers and publishers keep for themselves, and the identity fields."""

from __future__ import annotations

import pytest

from mongo_outbox import Event, InvalidEventError


@pytest.mark.parametrize(
    "name",
    ["a:b", "has space", "line\r\nbreak", "", "tab\t", "é", "semi;colon", "(paren)", "a/b"],
)
def test_a_header_name_that_is_not_a_token_is_refused(name: str) -> None:
    with pytest.raises(InvalidEventError, match="not a token"):
        Event(type="x", headers={name: "v"})


@pytest.mark.parametrize(
    "value", ["a\r\nNats-Rollup: sub", "a\nb", "a\rb", "nul\x00", "bell\x07", "del\x7f", " x", "x "]
)
def test_a_header_value_no_broker_carries_unchanged_is_refused(value: str) -> None:
    with pytest.raises(InvalidEventError):
        Event(type="x", headers={"h": value})


def test_header_names_and_values_that_every_broker_carries_are_kept() -> None:
    headers = {
        "tenant": "acme",
        "X-Request-Id": "r-1",
        "!#$%&'*+-.^_`|~09azAZ": "tab\tinside, unicode é, symbols :;=@",
        "empty": "",
    }
    assert Event(type="x", headers=headers).headers == headers


@pytest.mark.parametrize(
    "name",
    [
        "Nats-Rollup",
        "nats-expected-last-sequence",
        "NATS-MSG-ID",
        "Nats-TTL",
        "event-type",
        "Aggregate-Type",
        "aggregate-id",
        "Sequence",
        "content-type",
        "CC",
        "bcc",
        "x-death",
        "X-First-Death-Queue",
        "x-last-death-reason",
        "x-delay",
    ],
)
def test_headers_the_broker_or_the_publisher_act_on_are_reserved(name: str) -> None:
    with pytest.raises(InvalidEventError, match="reserved") as error:
        Event(type="x", id="e-1", headers={name: "v"})
    assert error.value.event_id == "e-1"


def test_a_header_name_given_twice_in_different_case_is_refused() -> None:
    with pytest.raises(InvalidEventError, match="twice"):
        Event(type="x", headers={"Tenant": "a", "tenant": "b"})


@pytest.mark.parametrize("field", ["id", "correlation_id", "causation_id"])
def test_identity_fields_fit_an_amqp_short_string(field: str) -> None:
    assert getattr(Event(type="x", **{field: "i" * 255}), field) == "i" * 255
    assert getattr(Event(type="x", **{field: "é" * 127}), field) == "é" * 127  # 254 bytes
    for bad in ("i" * 256, "é" * 128, "a\r\nb", " padded"):
        with pytest.raises(InvalidEventError, match=field):
            Event(type="x", **{field: bad})


def test_the_rules_hold_for_events_read_back_too() -> None:
    body = Event(type="x", headers={"ok": "1"}).model_dump_json()
    with pytest.raises(InvalidEventError):
        Event.from_json(body.replace('"ok"', '"Nats-Rollup"'))
