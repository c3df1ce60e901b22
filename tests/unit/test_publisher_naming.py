"""A publisher's naming (subject, routing key, stream, destination) is checked when the
publisher is made: a template that names no field of an event, an empty or non-str name, or a
synchronous Redis client would have refused (parked) every event it was given instead."""

from __future__ import annotations

import re
from typing import Any

import pytest
import redis
import redis.asyncio
from faststream.redis import RedisBroker
from hypothesis import given, settings
from hypothesis import strategies as st

from mongo_outbox import ConfigurationError, Event, InvalidEventError
from mongo_outbox.brokers._publishing import check_naming, render
from mongo_outbox.brokers.nats.publisher import subject_of
from mongo_outbox.publishers import (
    FastStreamPublisher,
    NatsPublisher,
    RabbitMQPublisher,
    RedisStreamsPublisher,
)

# Never used to publish: the checks run before anything reaches a broker.
MAKERS: dict[str, Any] = {
    "NatsPublisher.subject": lambda name: NatsPublisher(None, subject=name),  # type: ignore[arg-type]
    "RabbitMQPublisher.routing_key": lambda name: RabbitMQPublisher(None, routing_key=name),  # type: ignore[arg-type]
    "RedisStreamsPublisher.stream": lambda name: RedisStreamsPublisher(
        redis.asyncio.Redis(), stream=name
    ),
    "FastStreamPublisher.destination": lambda name: FastStreamPublisher(RedisBroker(), name),
}


@pytest.mark.parametrize("setting", list(MAKERS))
@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("", "must be a non-empty str template or a function of the event"),
        (None, "must be a non-empty str template or a function of the event"),
        (7, "must be a non-empty str template or a function of the event"),
        ("{orders}", "names {orders}, which is no field of an event"),
        ("x.{0}", "names {0}, which is no field of an event"),
        ("x.{}", "names {}, which is no field of an event"),
        ("x.{type", "is no template"),
        ("x.}", "is no template"),
    ],
)
def test_a_name_no_event_can_have_is_refused_when_the_publisher_is_made(
    setting: str, name: object, said: str
) -> None:
    if name == "" and setting == "RabbitMQPublisher.routing_key":
        # A fanout or headers exchange routes on nothing: "" is its usual routing key.
        assert MAKERS[setting](name).routing_key == ""
        return
    with pytest.raises(ConfigurationError, match=re.escape(said)) as refused:
        MAKERS[setting](name)
    assert refused.value.setting == setting


@pytest.mark.parametrize(
    "name",
    ["events", "{type}", "{{orders}}", "x.{headers[tenant]}.{payload[n]}", "{type.upper}"],
)
def test_templates_over_the_event_s_fields_and_literal_braces_are_taken(name: str) -> None:
    assert check_naming(name, "x") == name


def test_a_doubled_brace_names_the_literal_brace() -> None:
    assert render("{{orders}}", Event(type="e")) == "{orders}"


@pytest.mark.parametrize(
    "name",
    [
        "events.{aggregate_type}.{type}",
        "x.{headers[tenant]}.{payload[n]}",
        "{type.upper}",
        "{aggregate_id:>{sequence}}",  # a field nested in the format spec
        "{sequence:>{aggregate_type}}",  # ... that cannot format
        "{aggregate_type}.{correlation_id}",  # an unset field
        "{payload[missing]}",
        "{type[9]}",
        "{occurred_at.year}-{version:03d}",
    ],
)
def test_a_template_renders_over_the_fields_it_names_as_over_all(name: str) -> None:
    # render reads only the fields a template names; it says and refuses what a format over
    # every set field would.
    event = Event(
        type="order.placed",
        payload={"n": 4},
        aggregate_type="orders",
        aggregate_id="o-1",
        sequence=7,
        headers={"tenant": "acme"},
    )
    fields = {k: v for k, v in event.__dict__.items() if v is not None}
    try:
        expected: object = name.format_map(fields)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as error:
        expected = type(error)
    try:
        got: object = render(name, event)
    except InvalidEventError as refused:
        got = type(refused.__cause__)
    assert got == expected


def test_a_function_is_taken_as_it_is() -> None:
    def naming(event: Event) -> str:
        return event.type

    assert check_naming(naming, "x") is naming


def test_redis_streams_publisher_refuses_a_synchronous_client_and_a_maxlen_redis_refuses() -> None:
    # A synchronous client ran each XADD, then failed on awaiting its answer: every retry
    # added the entry again.
    with pytest.raises(ConfigurationError, match="needs an asyncio client"):
        RedisStreamsPublisher(redis.Redis())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="beyond what Redis takes"):
        RedisStreamsPublisher(redis.asyncio.Redis(), maxlen=2**63)
    assert RedisStreamsPublisher(redis.asyncio.Redis(), maxlen=2**63 - 1).maxlen == 2**63 - 1


_TOKENS = st.sampled_from(["orders", "order.placed", "Orders", "orders ", "", "ä", "1", "a*b"])


@settings(max_examples=200, deadline=None)
@given(
    template=st.sampled_from(
        [
            "events.{aggregate_type}.{type}",
            "{type}",
            "x.{aggregate_type}",
            "x.{correlation_id}.{type}",
            "x.{aggregate_id}.{sequence}",
            "x.{aggregate_id:03}",
            "x.{aggregate_id!r}",
            "x.{payload[k]}",
        ]
    ),
    events=st.lists(
        st.fixed_dictionaries(
            {
                "type": _TOKENS.filter(bool),
                "aggregate_type": st.none() | _TOKENS,
                "aggregate_id": st.sampled_from([1, "1", True, "True"]),
                "sequence": st.none() | st.sampled_from([1, 2]),
                "correlation_id": st.none() | _TOKENS.filter(bool),
                "payload": st.fixed_dictionaries({"k": st.sampled_from([1, True, "1"])}),
            }
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_a_nats_subject_is_what_its_template_renders_for_every_event_in_turn(
    template: str, events: list[dict[str, Any]]
) -> None:
    # NatsPublisher keeps each rendered subject by the values it names: every event, one after
    # the other on one publisher, still gets what rendering it alone gives, or its error.
    publisher = NatsPublisher(None, subject=template)  # type: ignore[arg-type]
    for fields in events:
        try:
            event = Event(**fields)
        except InvalidEventError:
            continue  # no Event: nothing to publish
        try:
            expected: str | type[InvalidEventError] = subject_of(template, event)
        except InvalidEventError:
            expected = InvalidEventError
        if expected is InvalidEventError:
            with pytest.raises(InvalidEventError):
                publisher._subject(event)
        else:
            assert publisher._subject(event) == expected


def test_a_nats_subject_follows_a_template_set_anew() -> None:
    publisher = NatsPublisher(None, subject="a.{type}")  # type: ignore[arg-type]
    event = Event(type="t", payload={})
    assert publisher._subject(event) == "a.t"
    publisher.subject = "b.{type}"
    assert publisher._subject(event) == "b.t"


def test_an_event_made_without_validation_is_refused_alone() -> None:
    # Its fields may be missing or unhashable: refused as the template cannot render it, not
    # with a KeyError that would fail every event sent beside it.
    publisher = NatsPublisher(None, subject="x.{type}")  # type: ignore[arg-type]
    assert publisher._subject(Event(type="t", payload={})) == "x.t"
    with pytest.raises(InvalidEventError):
        publisher._subject(Event.model_construct(payload={}))
    unhashable = Event(type="t", payload={}).model_copy(update={"type": ["t"]})
    assert publisher._subject(unhashable) == "x.['t']"
