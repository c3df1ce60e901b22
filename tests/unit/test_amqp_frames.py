"""The RabbitMQ publisher's own frame encoder writes, byte for byte, what pamqp (and so
aio-pika) writes for the same message: the properties and headers consumers read are unchanged
by the lean path, and its sizes (checked against ``frame_max``) are the real ones."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pamqp.frame
import pytest
from pamqp import commands as spec
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from mongo_outbox import Event
from mongo_outbox.brokers._publishing import message_headers
from mongo_outbox.brokers.rabbitmq._confirms import ConfirmWindow, Encoder

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def pamqp_frames(channel: int, exchange: str, key: str, event: Event, frame_max: int) -> bytes:
    """The frames aiormq's ``basic_publish`` writes for the publisher's message."""
    body = event.model_dump_json().encode()
    # AMQP's timestamp is unsigned (pamqp cannot encode one before 1970): such a message has none.
    timestamp = event.occurred_at if event.occurred_at >= EPOCH else None
    properties = spec.Basic.Properties(
        content_type="application/json",
        correlation_id=event.correlation_id,
        delivery_mode=2,
        headers=message_headers(event),  # type: ignore[arg-type]
        message_id=event.id,
        message_type=event.type,
        priority=0,
        timestamp=timestamp,
    )
    frames: list[Any] = [
        spec.Basic.Publish(exchange=exchange, routing_key=key, mandatory=True),
        ContentHeader(0, len(body), properties),
    ]
    room = frame_max - 8
    frames += [ContentBody(body[i : i + room]) for i in range(0, len(body), room)]
    return b"".join(pamqp.frame.marshal(frame, channel) for frame in frames)


def ours(channel: int, exchange: str, key: str, event: Event, frame_max: int) -> bytes:
    encoder = Encoder(exchange)
    body = event.model_dump_json().encode()
    header = encoder.content_header(
        channel,
        len(body),
        headers=message_headers(event),
        message_id=event.id,
        message_type=event.type,
        timestamp=event.occurred_at,
        correlation_id=event.correlation_id,
    )
    return encoder.method(channel, key) + header + encoder.body(channel, body, frame_max)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"correlation_id": "corr-1", "headers": {"tenant": "acmé", "b": "", "a" * 128: "x"}},
        {"aggregate_type": "orders", "aggregate_id": 7, "sequence": 3},
        {"type": "é" * 127, "payload": {"text": "ü" * 50_000}},  # body over several frames
        {"occurred_at": datetime(2026, 1, 2, 3, 4, 5, 999_999, tzinfo=timezone.utc)},
        {"occurred_at": EPOCH},
        {"occurred_at": EPOCH - timedelta(microseconds=1)},  # no timestamp: before 1970
        {"occurred_at": datetime(1, 1, 1, tzinfo=timezone.utc)},
    ],
)
def test_encoded_frames_are_the_bytes_pamqp_writes(fields: dict[str, Any]) -> None:
    kind, payload = fields.pop("type", "order.placed"), fields.pop("payload", {})
    event = Event(type=kind, payload=payload, **fields)
    for channel, frame_max in ((1, 131_072), (65_535, 4_096)):
        expected = pamqp_frames(channel, "events", "order.placed", event, frame_max)
        assert ours(channel, "events", "order.placed", event, frame_max) == expected


def test_a_routing_key_s_method_frame_is_encoded_once() -> None:
    encoder = Encoder("events")
    assert encoder.method(1, "k") is encoder.method(1, "k")
    assert encoder.method(2, "k") != encoder.method(1, "k")  # the channel is in the frame


@pytest.mark.parametrize(
    ("version", "limit"),
    [
        (b"3.10.8", 128 * 1024 * 1024),
        (b"4.0.5", 16 * 1024 * 1024),
        ("4.1.0", 16 * 1024 * 1024),
        (b"", 16 * 1024 * 1024),  # a server that does not say: the lower, newer one
    ],
)
def test_the_message_size_limit_is_by_default_the_servers_versions(
    version: Any, limit: int
) -> None:
    # FAKE connection and channel: the window reads only these attributes when it opens.
    connection = SimpleNamespace(
        server_properties={"version": version}, connection_tune=SimpleNamespace(frame_max=4096)
    )
    window = ConfirmWindow(SimpleNamespace(), connection)  # type: ignore[arg-type]
    assert window.message_max == limit
