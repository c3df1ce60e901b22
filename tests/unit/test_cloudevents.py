"""The CloudEvents mapping, checked against the official SDK (``cloudevents`` from PyPI): what
we write it reads as a valid event with the same attributes and data, what it writes we read
back as the same Event, and bad input is refused saying what is wrong."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from cloudevents.core.bindings import amqp, http, kafka, rabbitmq
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from hypothesis import example, given
from hypothesis import strategies as st

from mongo_outbox import ConfigurationError, Event, InvalidEventError
from mongo_outbox.cloudevents import (
    CONTENT_TYPE,
    CloudEvents,
    attributes_of,
    message_of,
    read_binary,
    read_cloudevent,
    read_message,
    read_structured,
    structured_of,
)
from tests.unit.test_entry_codec import EVENTS, JSON, KEY

SOURCE = "urn:example:orders"
_text = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x2FF, exclude_categories=("Cc", "Cs")),
    min_size=1,
    max_size=12,
)
_keys = st.text("abcxyz_é-", min_size=1, max_size=6)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
    max_leaves=8,
)
_trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@st.composite
def events(draw: st.DrawFn) -> Event:
    at = draw(
        st.datetimes(
            min_value=datetime(1970, 1, 2),
            max_value=datetime(2200, 1, 1),
            timezones=st.just(timezone.utc),
        )
    )
    return Event(
        type=draw(_text),
        payload=draw(st.dictionaries(_keys, _json, max_size=4)),
        aggregate_type=draw(st.none() | _text),
        aggregate_id=draw(st.none() | _text),
        sequence=draw(st.none() | st.integers(1, 2**40)),
        occurred_at=at,
        correlation_id=draw(st.none() | _text),
        causation_id=draw(st.none() | _text),
        version=draw(st.integers(1, 9)),
        headers=draw(st.sampled_from([{}, {"traceparent": _trace}, {"tenant": "acme"}])),
    )


def _same_event(read: Event, sent: Event) -> None:
    assert read.model_dump() == sent.model_dump()


def _as_sdk_sees_it(ce: Any, event: Event) -> None:
    """The SDK's event has every attribute of the mapping, and the payload as its data."""
    assert ce.get_specversion() == "1.0"
    assert ce.get_id() == event.id
    assert ce.get_source() == SOURCE
    assert ce.get_type() == event.type
    assert ce.get_time() == event.occurred_at
    assert ce.get_subject() == event.aggregate_id
    assert ce.get_datacontenttype() == "application/json"
    assert ce.get_data() == event.payload
    extensions = {k: str(ce.get_extension(k)) for k in ce.get_attributes() if ce.get_extension(k)}
    assert extensions.get("eventversion") == str(event.version)
    assert extensions.get("sequence") == (None if event.sequence is None else str(event.sequence))
    assert extensions.get("aggregatetype") == event.aggregate_type
    assert extensions.get("correlationid") == event.correlation_id
    assert extensions.get("causationid") == event.causation_id
    assert extensions.get("traceparent") == event.headers.get("traceparent")


@given(events())
def test_the_sdk_reads_a_structured_event_and_we_read_it_back(event: Event) -> None:
    body = structured_of(event, SOURCE)
    _as_sdk_sees_it(http.from_structured(http.HTTPMessage({}, body), JSONFormat()), event)
    _same_event(read_structured(body, headers=event.headers).event, event)


@given(events())
@example(Event(type="%00", occurred_at=datetime(2026, 1, 2, tzinfo=timezone.utc)))
def test_the_sdk_reads_nats_binary_headers_and_we_read_them_back(event: Event) -> None:
    headers, content_type, body = message_of(event, CloudEvents(SOURCE), "ce-", dict(event.headers))
    assert all(not k.lower().startswith("content-type") for k in headers)
    # The NATS binding is HTTP's: ce- headers, datacontenttype as Content-Type.
    message = http.HTTPMessage(headers | {"Content-Type": content_type}, body)
    _as_sdk_sees_it(http.from_binary(message, JSONFormat()), event)
    received = read_binary(headers, body, content_type=content_type)
    _same_event(received.event, event)
    assert received.source == SOURCE


@given(events())
def test_the_sdk_reads_amqp_application_properties_and_we_read_them_back(event: Event) -> None:
    headers, content_type, body = message_of(
        event, CloudEvents(SOURCE), "cloudEvents_", dict(event.headers)
    )
    message = amqp.AMQPMessage({"content-type": content_type}, headers, body)
    _as_sdk_sees_it(amqp.from_amqp(message, JSONFormat()), event)
    _same_event(read_message(headers, body, content_type=content_type).event, event)


# Values the HTTP and NATS bindings' ce- headers must percent-encode (3.1.3.2), or that look
# like an encoding already: a type of '%00' written as it was read as NUL in the SDK.
_ENCODED = [
    ("%00", "%2500"),
    ("%", "%25"),
    ("a b", "a%20b"),
    ('say "hi"', "say%20%22hi%22"),
    ('"quoted"', "%22quoted%22"),
    ("é", "%C3%A9"),
    ("Euro \u20ac \U0001f600", "Euro%20%E2%82%AC%20%F0%9F%98%80"),  # the binding's example
    ("%41+/:?#&=~", "%2541+/:?#&=~"),
]


@pytest.mark.parametrize(("value", "header"), _ENCODED)
def test_ce_header_values_are_percent_encoded_and_read_back_by_us_and_the_sdk(
    value: str, header: str
) -> None:
    event = Event(type=value, aggregate_id=value, correlation_id=value)
    headers, content_type, body = message_of(event, CloudEvents(SOURCE), "ce-", {})
    assert headers["ce-type"] == headers["ce-subject"] == headers["ce-correlationid"] == header
    _same_event(read_binary(headers, body, content_type=content_type).event, event)
    message = http.HTTPMessage(headers | {"Content-Type": content_type}, body)
    read = http.from_binary(message, JSONFormat())
    assert (read.get_type(), read.get_subject()) == (value, value)
    assert read.get_extension("correlationid") == value


@pytest.mark.parametrize(("value", "header"), _ENCODED)
def test_the_sdks_percent_encoded_ce_headers_read_as_what_it_wrote(value: str, header: str) -> None:
    ce = _sdk_event(type=value, subject=value, note=value)
    message = http.to_binary(ce, JSONFormat())
    headers = dict(message.headers)
    assert headers["ce-type"] == header
    received = read_message(headers, message.body, content_type=headers["content-type"])
    assert (received.event.type, received.event.aggregate_id) == (value, value)
    assert received.extensions["note"] == value


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("%c3%a9", "é"),  # lower-case hex: decoders must accept it
        ("%41bc", "Abc"),  # encoded though it need not be
        ('"a \\"b\\" c"', 'a "b" c'),  # a quoted string, as older senders could write
        ('"%25"', "%"),  # unquoted, then decoded once
        ("%2541", "%41"),  # one round only
        ("100%", "100%"),  # no escape: as it came
    ],
)
def test_ce_header_values_are_unquoted_then_percent_decoded_once(header: str, value: str) -> None:
    headers = {"ce-specversion": "1.0", "ce-id": "e-1", "ce-source": "/s", "ce-type": header}
    assert read_binary(headers, b"{}").event.type == value


def test_a_ce_header_whose_escapes_are_no_utf8_is_refused() -> None:
    headers = {"ce-specversion": "1.0", "ce-id": "e-1", "ce-source": "/s", "ce-type": "%C0%A0"}
    with pytest.raises(InvalidEventError, match=r"'ce-type'.*percent-encodes no UTF-8"):
        read_binary(headers, b"{}")


def test_values_earlier_versions_wrote_unencoded_read_as_they_were_unless_they_hold_escapes() -> (
    None
):
    """Before this library encoded ce- values it wrote them as they were: one without '%'
    reads the same, one holding '%' and two hex digits reads decoded (docs/cloudevents.md)."""
    headers = {"ce-specversion": "1.0", "ce-id": "e-1", "ce-source": "/s", "ce-subject": "o 1"}
    for written, read in [('a b"é', 'a b"é'), ("50%", "50%"), ("%41", "A")]:
        received = read_binary(headers | {"ce-type": written}, b"{}")
        assert (received.event.type, received.event.aggregate_id) == (read, "o 1")


@pytest.mark.parametrize("prefix", ["ce_", "cloudEvents_"])
def test_kafka_and_amqp_attribute_values_go_and_come_as_they_are(prefix: str) -> None:
    event = Event(type="%41 é", aggregate_id='"o 1"')
    headers, content_type, body = message_of(event, CloudEvents(SOURCE), prefix, {})
    assert headers[prefix + "type"] == "%41 é" and headers[prefix + "subject"] == '"o 1"'
    _same_event(read_binary(headers, body, content_type=content_type).event, event)


def test_knative_rabbitmq_ce_headers_are_read_as_they_are_when_told_they_are_not_encoded() -> None:
    ce = _sdk_event(type="%41 é", subject='"o 1"')
    message = rabbitmq.to_binary(ce, JSONFormat())
    assert message.headers["ce-type"] == "%41 é"  # the RabbitMQ binding encodes nothing
    received = read_message(
        message.headers, message.body, content_type=message.content_type, percent_encoded=False
    )
    assert (received.event.type, received.event.aggregate_id) == ("%41 é", '"o 1"')


def _sdk_event(**extra: Any) -> CloudEvent:
    attributes = {
        "id": "e-1",
        "source": "https://billing.example.com/v1",
        "type": "com.example.invoice.paid",
        "time": datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=timezone(timedelta(hours=2))),
        "datacontenttype": "application/json",
        "subject": "inv-7",
        "region": "eu",  # an extension of the other producer's
    } | extra
    return CloudEvent(attributes, {"amount": 12, "paid": True})


@pytest.mark.parametrize(
    "encode",
    [
        lambda ce: (dict(http.to_binary(ce, JSONFormat()).headers), None),
        lambda ce: (
            {"Content-Type": CONTENT_TYPE},
            http.to_structured(ce, JSONFormat()).body,
        ),
        lambda ce: (
            {k: v.decode() for k, v in kafka.to_binary(ce, JSONFormat()).headers.items()},
            None,
        ),
        lambda ce: (  # time as an AMQP timestamp: milliseconds since the epoch
            amqp.to_binary(ce, JSONFormat()).application_properties
            | {"content-type": "application/json"},
            None,
        ),
    ],
    ids=["ce-headers", "structured", "kafka-ce_-headers", "amqp-cloudEvents_-properties"],
)
def test_an_sdk_event_reads_as_the_event_it_describes(encode: Any) -> None:
    ce = _sdk_event()
    headers, body = encode(ce)
    if body is None:
        body = JSONFormat().write_data(ce.get_data(), "application/json")
    content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), None)
    received = read_message(headers, body, content_type=content_type)
    assert (received.id, received.source) == ("e-1", "https://billing.example.com/v1")
    assert received.event.type == "com.example.invoice.paid"
    assert received.event.occurred_at == ce.get_time()
    assert received.event.aggregate_id == "inv-7"
    assert received.event.payload == {"amount": 12, "paid": True}
    assert received.event.version == 1  # no eventversion: the first version
    assert received.extensions == {"region": "eu"}


def test_an_sdk_event_in_process_reads_through_its_attributes() -> None:
    ce = _sdk_event(eventversion=2)
    received = read_cloudevent(ce.get_attributes(), ce.get_data())
    assert received.event.version == 2 and received.source == ce.get_source()


@pytest.mark.parametrize("missing", ["id", "source", "specversion", "type"])
def test_a_cloudevent_without_a_required_attribute_is_refused_by_name(missing: str) -> None:
    attributes = attributes_of(Event(type="placed"), SOURCE)
    del attributes[missing]
    with pytest.raises(InvalidEventError, match=f"lacks the required attribute.*{missing}"):
        read_cloudevent(attributes, {})


@pytest.mark.parametrize(
    ("change", "data", "says"),
    [
        ({"specversion": "0.3"}, {}, "specversion '0.3' is not 1.0"),
        ({"source": "not a uri"}, {}, "source 'not a uri' is not a URI reference"),
        ({"datacontenttype": "text/plain"}, {}, "datacontenttype 'text/plain' is not JSON"),
        ({}, [1, 2], "its data is list, not a JSON object"),
        ({}, b"{", "its data is not JSON"),
        ({"time": "yesterday"}, {}, "time 'yesterday' is not an RFC 3339 timestamp"),
        ({"sequence": "x"}, {}, "sequence 'x' is not an integer"),
        ({"eventversion": "0"}, {}, "maps to no Event"),
    ],
)
def test_a_bad_cloudevent_is_refused_saying_what_is_wrong(
    change: dict[str, str], data: Any, says: str
) -> None:
    attributes = attributes_of(Event(type="placed"), SOURCE) | change
    with pytest.raises(InvalidEventError, match=says) as raised:
        read_cloudevent(attributes, data)
    assert raised.value.event_id == attributes["id"]


def test_a_structured_body_with_binary_data_is_refused() -> None:
    with pytest.raises(InvalidEventError, match="data_base64"):
        read_structured(b'{"id":"1","source":"/s","specversion":"1.0","type":"t","data_base64":""}')


@given(
    st.text(min_size=1, max_size=20).filter(
        lambda s: any(c.isspace() or c in '"<>\\^`{|}' or ord(c) > 126 for c in s)
    )
)
def test_a_source_that_is_no_uri_reference_is_refused(source: str) -> None:
    with pytest.raises(ConfigurationError, match="is not a URI reference") as raised:
        CloudEvents(source)
    assert raised.value.setting == "CloudEvents.source"


@pytest.mark.parametrize(
    "source", ["/orders", "urn:example:orders", "https://example.com/a?b=c#d", "orders%20v1"]
)
def test_uri_references_are_sources(source: str) -> None:
    assert CloudEvents(source).source == source


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [({"source": ""}, "non-empty URI reference"), ({"source": "/s", "mode": "json"}, "mode")],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        CloudEvents(**kwargs)


def test_an_event_header_that_reads_as_an_attribute_is_refused() -> None:
    event = Event(type="placed", headers={"ce-id": "other"})
    with pytest.raises(InvalidEventError, match="would read as a CloudEvents attribute"):
        message_of(event, CloudEvents(SOURCE), "ce-", dict(event.headers))


@pytest.mark.parametrize(
    ("time", "at"),
    [
        ("2026-01-02T03:04:05.123456789Z", datetime(2026, 1, 2, 3, 4, 5, 123000, timezone.utc)),
        ("2026-01-02t03:04:05.5z", datetime(2026, 1, 2, 3, 4, 5, 500000, timezone.utc)),
        ("2026-01-02T05:04:05+02:00", datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)),
        ("2026-01-02T03:04:05-00:30", datetime(2026, 1, 2, 3, 34, 5, tzinfo=timezone.utc)),
        ("2016-12-31T23:59:60Z", datetime(2017, 1, 1, tzinfo=timezone.utc)),
    ],
)
def test_rfc3339_times_of_other_producers_read_the_same_on_every_python(
    time: str, at: datetime
) -> None:
    attributes = attributes_of(Event(type="placed"), SOURCE) | {"time": time}
    assert read_cloudevent(attributes, {}).event.occurred_at == at


@pytest.mark.parametrize(
    "time", ["2026-13-01T00:00:00Z", "2026-01-02T03:04:05", "2026-01-02", "2026-01-02T03:04Z"]
)
def test_a_time_that_is_no_rfc3339_timestamp_is_refused(time: str) -> None:
    attributes = attributes_of(Event(type="placed"), SOURCE) | {"time": time}
    with pytest.raises(InvalidEventError, match="is not an RFC 3339 timestamp"):
        read_cloudevent(attributes, {})


def test_another_producers_typed_extensions_are_handed_on_as_they_came() -> None:
    ce = _sdk_event(sampled=True, retries=3)
    message = amqp.to_binary(ce, JSONFormat())
    assert message.application_properties["cloudEvents_sampled"] is True  # an AMQP boolean
    received = read_binary(
        message.application_properties,
        message.application_data,
        content_type=message.properties["content-type"],
    )
    assert received.extensions == {"region": "eu", "sampled": True, "retries": 3}


def test_headers_an_event_cannot_hold_are_left_out_not_fatal() -> None:
    headers = {
        "ce-specversion": "1.0",
        "ce-id": "e-1",
        "ce-source": "/billing",
        "ce-type": "paid",
        "Tenant": "acme",
        "tenant": "other",  # the same name in another case
        "my header": "x",  # no token
        "bell": "\x07",
        "x-delivery-count": 2,  # the broker's
        "outbox-retries": 1,  # no text
        "Nats-Msg-Id": "e-1",
    }
    received = read_binary(headers, b"{}", content_type="application/json")
    assert received.event.headers == {"Tenant": "acme"}


@given(event=EVENTS, payload=st.dictionaries(KEY, JSON | st.floats(-1e300, 1e300)))
def test_without_cloudevents_the_body_is_the_events_own_json_byte_for_byte(
    event: Event, payload: dict[str, Any]
) -> None:
    event = Event(**(event.__dict__ | {"payload": payload}))
    # A copy may hold keys beside the fields in its __dict__: they are not sent.
    for sent in (event, event.model_copy(update={"type": "other", "extra": 1})):
        headers, content_type, body = message_of(sent, None, "ce-", {"a": "b"})
        assert (headers, content_type) == ({"a": "b"}, "application/json")
        assert body == sent.model_dump_json().encode()
        assert Event.from_json(body).model_dump() == sent.model_dump()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_copy_with_a_value_json_cannot_hold_is_sent_as_the_model_writes_it(value: float) -> None:
    # model_copy(update=...) skips validation, which refuses such a payload: the body must
    # still be what model_dump_json writes (null), never the invalid JSON token NaN.
    sent = Event(type="t").model_copy(update={"payload": {"x": value}})
    body = message_of(sent, None, "ce-", {})[2]
    assert body == sent.model_dump_json().encode()
    assert b"null" in body
