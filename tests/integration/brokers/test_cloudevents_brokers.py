"""CloudEvents on the real NATS JetStream, RabbitMQ and Redis, checked with the official SDK
(``cloudevents`` from PyPI), which no one here wrote: it reads what the publishers send as valid
events with the same attributes and data, and the events it writes are handled once by the
consumers' inbox guard, identified by their ``source`` and ``id``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import pytest
from cloudevents.core.bindings import amqp, http, rabbitmq
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from redis.asyncio import Redis

from mongo_outbox import Event, Inbox, InvalidEventError, inbox_guard
from mongo_outbox.cloudevents import CloudEvents, read_cloudevent
from mongo_outbox.consumers import consume_nats, consume_rabbitmq, consume_redis
from mongo_outbox.inbox import Guarded
from mongo_outbox.publishers import NatsPublisher, RabbitMQPublisher, RedisStreamsPublisher
from tests.support.servers import NATS_URL, RABBITMQ_URL, REDIS_URL
from tests.support.waiting import until

SOURCE = "https://shop.example.com/orders"
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _events() -> list[Event]:
    return [
        Event(
            type="order.placed",
            aggregate_type="orders",
            aggregate_id=f"o-{n}",
            sequence=n,
            version=2,
            payload={"total": n * 10, "lines": [{"sku": "a", "qty": n}]},
            correlation_id=f'c-{n} é "%41"',  # percent-encoded in ce- headers, raw in AMQP's
            headers={"traceparent": TRACE, "tenant": "acme"},
        )
        for n in (1, 2)
    ]


def _check(ce: Any, event: Event) -> None:
    assert ce.get_id() == event.id
    assert ce.get_source() == SOURCE
    assert ce.get_type() == event.type
    assert ce.get_time() == event.occurred_at
    assert ce.get_subject() == event.aggregate_id
    assert ce.get_datacontenttype() == "application/json"
    assert ce.get_data() == event.payload
    assert str(ce.get_extension("eventversion")) == "2"
    assert str(ce.get_extension("sequence")) == str(event.sequence)
    assert ce.get_extension("aggregatetype") == "orders"
    assert ce.get_extension("correlationid") == event.correlation_id
    assert ce.get_extension("traceparent") == TRACE


def _billing(db: Any, name: str) -> tuple[Guarded, list[tuple[str, str]]]:
    """A guarded handler that records one effect per call, in the inbox's transaction."""
    seen: list[tuple[str, str]] = []

    @inbox_guard(Inbox(db, consumer=name))
    async def bill(event: Event, session: Any) -> None:
        await db.effects.insert_one({"event": event.id, "payload": event.payload}, session=session)
        seen.append((event.id, event.type))

    return bill, seen


async def _effects_once(
    db: Any, seen: list[tuple[str, str]], deliveries: Callable[[], Awaitable[int]]
) -> None:
    """Two deliveries of each of two events from two sources, one sharing the other's id:
    three effects, each once, and the inbox keyed on (source, id)."""
    sent = await deliveries()
    await until(lambda: len(seen) >= 3)
    await asyncio.sleep(0.3)  # a duplicate, handled twice, would show by now
    assert sent == 6
    assert sorted(seen) == [
        ("e-1", "invoice.paid"),
        ("e-1", "invoice.paid"),
        ("e-2", _ENCODED_TYPE),
    ]
    assert await db.effects.count_documents({}) == 3
    identities = {(r["source"], r["message_id"]) async for r in db.inbox.find()}
    assert identities == {("/billing", "e-1"), ("urn:other:ledger", "e-1"), ("/billing", "e-2")}


# A type the HTTP binding percent-encodes (and that reads as an escape if decoded twice), and
# that AMQP's and knative's RabbitMQ bindings carry as it is.
_ENCODED_TYPE = "x %41 é"


def _sdk_events() -> list[CloudEvent]:
    base = {"specversion": "1.0", "type": "invoice.paid", "datacontenttype": "application/json"}
    return [
        CloudEvent(base | {"id": "e-1", "source": "/billing", "subject": "inv-1"}, {"n": 1}),
        CloudEvent(base | {"id": "e-1", "source": "urn:other:ledger"}, {"n": 2}),
        CloudEvent(base | {"id": "e-2", "source": "/billing", "type": _ENCODED_TYPE}, {"n": 3}),
    ]


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_nats_messages_read_as_the_same_cloudevents_in_the_sdk(
    nats_client: Any, nats_stream: str, mode: str
) -> None:
    events = _events()
    publisher = await NatsPublisher.connect(
        NATS_URL, subject=f"{nats_stream}.{{type}}", cloudevents=CloudEvents(SOURCE, mode)
    )
    try:
        for event in events:
            await publisher.publish(event)
    finally:
        await publisher.aclose()
    subscription = await nats_client.jetstream().pull_subscribe(f"{nats_stream}.>", durable="sdk")
    messages = await subscription.fetch(2, timeout=5)
    for message, event in zip(messages, events, strict=True):
        headers = dict(message.headers)
        if mode == "binary":
            assert headers["ce-specversion"] == "1.0" and "ce-time" in headers
            read = http.from_binary(http.HTTPMessage(headers, message.data), JSONFormat())
        else:
            assert headers["Content-Type"] == "application/cloudevents+json"
            read = http.from_structured(http.HTTPMessage(headers, message.data), JSONFormat())
        _check(read, event)
        assert headers["tenant"] == "acme"  # the event's own header, beside the attributes


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_rabbitmq_messages_read_as_the_same_cloudevents_in_the_sdk(
    amqp_connection: Any, unique: str, mode: str
) -> None:
    channel = await amqp_connection.channel()
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(unique, exclusive=True)
    await queue.bind(exchange, "#")
    events = _events()
    publisher = await RabbitMQPublisher.connect(
        RABBITMQ_URL, exchange=unique, cloudevents=CloudEvents(SOURCE, mode)
    )
    try:
        for event in events:
            await publisher.publish(event)
        for event in events:
            message = await queue.get(timeout=5)
            await message.ack()
            headers = dict(message.headers)
            if mode == "binary":
                assert message.content_type == "application/json"
                assert headers["cloudEvents_specversion"] == "1.0"
            else:
                assert message.content_type == "application/cloudevents+json"
            read = amqp.from_amqp(
                amqp.AMQPMessage({"content-type": message.content_type}, headers, message.body),
                JSONFormat(),
            )
            _check(read, event)
            assert message.message_id == event.id
    finally:
        await publisher.aclose()
        await exchange.delete()
        await channel.close()


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_sdk_events_on_nats_are_handled_once_by_source_and_id(
    db: Any, nats_client: Any, nats_stream: str, mode: str
) -> None:
    js = nats_client.jetstream()
    bill, seen = _billing(db, "billing")

    async def deliveries() -> int:
        sent = 0
        for ce in _sdk_events():
            encode = http.to_binary if mode == "binary" else http.to_structured
            message = encode(ce, JSONFormat())
            for _ in range(2):  # delivered twice: no Nats-Msg-Id, so JetStream keeps both
                await js.publish(f"{nats_stream}.in", message.body, headers=message.headers)
                sent += 1
        return sent

    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_nats(js, f"{nats_stream}.in", "billing", bill, stream=nats_stream, stop=stop)
    )
    try:
        await _effects_once(db, seen, deliveries)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("mode", ["binary", "structured", "knative"])
async def test_sdk_events_on_rabbitmq_are_handled_once_by_source_and_id(
    db: Any, amqp_connection: Any, unique: str, mode: str
) -> None:
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique, exclusive=True)
    bill, seen = _billing(db, "billing")

    async def deliveries() -> int:
        sent = 0
        for ce in _sdk_events():
            if mode == "knative":  # ce- headers, their values as they are
                knative = rabbitmq.to_binary(ce, JSONFormat())
                body, headers = knative.body, dict(knative.headers)
                content_type = knative.content_type
            else:
                encode = amqp.to_binary if mode == "binary" else amqp.to_structured
                message = encode(ce, JSONFormat())
                body, headers = message.application_data, message.application_properties
                content_type = message.properties["content-type"]
            for _ in range(2):
                await channel.default_exchange.publish(
                    aio_pika.Message(body, headers=headers, content_type=content_type),
                    routing_key=unique,
                )
                sent += 1
        return sent

    stop = asyncio.Event()
    task = asyncio.create_task(consume_rabbitmq(queue, bill, stop=stop, retry_queues=False))
    try:
        await _effects_once(db, seen, deliveries)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await channel.close()


async def test_a_cloudevent_missing_its_source_is_rejected_by_the_consumer(
    db: Any, nats_client: Any, nats_stream: str
) -> None:
    js = nats_client.jetstream()
    bill, seen = _billing(db, "billing")
    rejected: list[str] = []

    async def on_rejected(body: bytes, reason: str) -> None:
        rejected.append(reason)

    headers = {"ce-specversion": "1.0", "ce-id": "e-9", "ce-type": "t"}
    await js.publish(f"{nats_stream}.in", b"{}", headers=headers)
    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_nats(
            js, f"{nats_stream}.in", "b", bill, stream=nats_stream, stop=stop, rejected=on_rejected
        )
    )
    try:
        await until(lambda: bool(rejected))
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert "not a usable CloudEvent" in rejected[0]
    assert "lacks the required attribute(s) source" in rejected[0]
    assert seen == [] and await db.inbox.count_documents({}) == 0


async def test_inbox_guard_handles_an_sdk_event_once_in_process(db: Any) -> None:
    bill, seen = _billing(db, "in-process")
    ce = _sdk_events()[0]
    for _ in range(2):
        received = read_cloudevent(ce.get_attributes(), ce.get_data())
        await bill(received.event, message_id=received.id, source=received.source)
    assert seen == [("e-1", "invoice.paid")]
    record = await db.inbox.find_one()
    assert (record["source"], record["message_id"]) == ("/billing", "e-1")


async def test_an_event_whose_header_reads_as_an_attribute_is_refused_before_it_is_sent(
    nats_stream: str, amqp_connection: Any, unique: str
) -> None:
    event = Event(type="placed", headers={"ce-source": "/elsewhere"})
    nats_publisher = await NatsPublisher.connect(
        NATS_URL, subject=f"{nats_stream}.{{type}}", cloudevents=CloudEvents(SOURCE)
    )
    rabbit_publisher = await RabbitMQPublisher.connect(
        RABBITMQ_URL, exchange=unique, cloudevents=CloudEvents(SOURCE, "structured")
    )
    try:
        for publisher in (nats_publisher, rabbit_publisher):
            with pytest.raises(InvalidEventError, match="'ce-source' would read as a CloudEvents"):
                await publisher.publish(event)
    finally:
        await nats_publisher.aclose()
        await rabbit_publisher.aclose()
        channel = await amqp_connection.channel()
        await channel.exchange_delete(unique)
        await channel.close()


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_redis_entries_read_as_the_same_cloudevents_in_the_sdk(
    unique: str, mode: str
) -> None:
    events = _events()
    publisher = await RedisStreamsPublisher.connect(
        REDIS_URL, stream=unique, cloudevents=CloudEvents(SOURCE, mode)
    )
    try:
        for event in events:
            await publisher.publish(event)
        entries = await publisher.redis.xrange(unique)
    finally:
        await publisher.redis.delete(unique)
        await publisher.aclose()
    for (_, fields), event in zip(entries, events, strict=True):
        # Redis has no binding: the entry's headers field holds what NATS headers would.
        headers = json.loads(fields[b"headers"])
        message = http.HTTPMessage(headers, fields[b"body"])
        if mode == "binary":
            read = http.from_binary(message, JSONFormat())
        else:
            assert headers["content-type"] == "application/cloudevents+json"
            read = http.from_structured(message, JSONFormat())
        _check(read, event)
        assert fields[b"event-id"].decode() == event.id


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_sdk_events_on_redis_are_handled_once_by_source_and_id(
    db: Any, unique: str, mode: str
) -> None:
    redis = Redis.from_url(REDIS_URL)
    bill, seen = _billing(db, "billing")

    async def deliveries() -> int:
        sent = 0
        for ce in _sdk_events():
            encode = http.to_binary if mode == "binary" else http.to_structured
            message = encode(ce, JSONFormat())
            fields = {"headers": json.dumps(message.headers), "body": message.body}
            for _ in range(2):
                await redis.xadd(unique, fields)
                sent += 1
        return sent

    stop = asyncio.Event()
    task = asyncio.create_task(consume_redis(redis, unique, "billing", bill, stop=stop))
    try:
        await _effects_once(db, seen, deliveries)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await redis.delete(unique)
        await redis.aclose()
