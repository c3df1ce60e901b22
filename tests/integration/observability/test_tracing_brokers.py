"""One trace from the save to the consumer, through the real NATS and RabbitMQ: the save's span,
the relay's producer span (its child), the guarded handler's consumer span (the producer's
child), with the producer's context on the broker message. Also the change-stream relay's
producer spans, a guard inside a framework's span, and the spans of failures."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from mongo_outbox import Event, Inbox, PollingRelay, inbox_guard
from mongo_outbox.changestream import ChangeStreamRelay
from mongo_outbox.consumers import handle_nats_message, handle_rabbitmq_message
from mongo_outbox.inbox import Outcome
from mongo_outbox.publishers import MemoryPublisher, NatsPublisher, RabbitMQPublisher
from mongo_outbox.settings import Backoff
from tests.support.changestream_sources import ScriptedSource, inserts
from tests.support.messages import bind_queue
from tests.support.outboxes import MODES, make_outbox
from tests.support.servers import RABBITMQ_URL
from tests.support.tracing import one, recorded_spans, traceparent
from tests.support.waiting import until


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with recorded_spans() as exporter:
        yield exporter


def billing(db: Any, handled: list[Any]) -> Any:
    """A guarded handler that writes an invoice inside a span of its own."""
    app = trace.get_tracer("shop")

    @inbox_guard(Inbox(db, consumer="billing"), backoff=Backoff(initial=0.05, maximum=0.1))
    async def bill(event: Event, session: Any) -> None:
        with app.start_as_current_span("bill"):
            handled.append(event)
            await db.invoices.insert_one({"event": event.id}, session=session)

    return bill


async def save_in_a_span(db: Any, mode: str) -> Event:
    outbox = make_outbox(db, mode)
    with trace.get_tracer("shop").start_as_current_span("checkout"):
        saved = await outbox.save_with_events(
            None, db.orders, {"_id": "o-1", "total": 42}, [Event(type="placed")]
        )
    return saved.events[0]


def check_trace(
    spans: tuple[ReadableSpan, ...],
    event: Event,
    destination: str,
    headers: Any,
    broker: dict[str, str],
) -> ReadableSpan:
    """save -> producer -> consumer -> the handler's span, one trace; returns the producer.
    ``broker``: the messaging attributes both the producer and the consumer span have."""
    save, producer = one(spans, "checkout"), one(spans, f"publish {destination}")
    consumer, handler = one(spans, f"process {destination}"), one(spans, "bill")
    assert save.parent is None
    assert {s.context.trace_id for s in (save, producer, consumer, handler)} == {
        save.context.trace_id
    }
    assert producer.kind is SpanKind.PRODUCER and producer.parent is not None
    assert producer.parent.span_id == save.context.span_id
    assert producer.status.status_code is StatusCode.UNSET
    assert producer.attributes is not None
    assert producer.attributes["messaging.message.id"] == event.id
    assert producer.attributes["messaging.operation.type"] == "send"
    assert {k: producer.attributes[k] for k in broker} == broker
    # The message carries the producer's context, so the consumer is its child.
    assert headers["traceparent"] == traceparent(producer)
    assert consumer.kind is SpanKind.CONSUMER and consumer.parent is not None
    assert consumer.parent.span_id == producer.context.span_id
    assert consumer.attributes == {
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": event.id,
        "messaging.consumer.group.name": "billing",
        "mongo_outbox.inbox.source": "orders",
        "mongo_outbox.inbox.outcome": "handled",
        "mongo_outbox.inbox.attempt": 1,
        **broker,
    }
    assert handler.parent is not None and handler.parent.span_id == consumer.context.span_id
    return producer


@pytest.mark.parametrize("mode", MODES)
async def test_one_trace_from_the_save_through_nats_to_the_consumer(
    db: Any, spans: InMemorySpanExporter, nats_client: Any, nats_stream: str, mode: str
) -> None:
    event = await save_in_a_span(db, mode)
    publisher = NatsPublisher(nats_client.jetstream(), subject=f"{nats_stream}.{{type}}")
    assert await PollingRelay(make_outbox(db, mode), publisher).drain() == 1
    js = nats_client.jetstream()
    subscription = await js.pull_subscribe(f"{nats_stream}.>", durable="billing")
    [message] = await subscription.fetch(1, timeout=10)
    handled: list[Event] = []
    assert await handle_nats_message(message, billing(db, handled)) is Outcome.HANDLED
    assert [e.id for e in handled] == [event.id]
    subject = f"{nats_stream}.placed"
    nats = {"messaging.system": "nats", "messaging.destination.name": subject}
    producer = check_trace(spans.get_finished_spans(), event, subject, message.headers, nats)
    # The event in the body carries the same context as the message's headers.
    assert handled[0].headers == {"traceparent": traceparent(producer)}


@pytest.mark.parametrize("mode", MODES)
async def test_one_trace_from_the_save_through_rabbitmq_to_the_consumer(
    db: Any, spans: InMemorySpanExporter, channel: Any, unique: str, mode: str
) -> None:
    event = await save_in_a_span(db, mode)
    queue = await bind_queue(channel, unique)
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    try:
        assert await PollingRelay(make_outbox(db, mode), publisher).drain() == 1
    finally:
        await publisher.aclose()
    message = await queue.get(timeout=10)
    handled: list[Event] = []
    assert await handle_rabbitmq_message(message, billing(db, handled)) is Outcome.HANDLED
    assert [e.id for e in handled] == [event.id]
    rabbitmq = {
        "messaging.system": "rabbitmq",
        "messaging.destination.name": unique,
        "messaging.rabbitmq.destination.routing_key": "placed",
    }
    check_trace(spans.get_finished_spans(), event, unique, message.headers, rabbitmq)


async def test_a_failed_publish_is_recorded_on_its_producer_span(
    db: Any, spans: InMemorySpanExporter
) -> None:
    event = await save_in_a_span(db, "collection")
    publisher = MemoryPublisher(fail=lambda e: RuntimeError("refused by the broker"))
    assert await PollingRelay(make_outbox(db), publisher).drain() == 0
    producer = one(spans.get_finished_spans(), "publish")
    assert producer.kind is SpanKind.PRODUCER
    assert producer.status.status_code is StatusCode.ERROR
    assert producer.attributes is not None
    assert producer.attributes["error.type"] == "RuntimeError"
    assert producer.attributes["messaging.message.id"] == event.id
    [recorded] = producer.events
    assert recorded.name == "exception" and recorded.attributes is not None
    assert recorded.attributes["exception.message"] == "refused by the broker"


async def test_a_failing_handler_is_recorded_on_its_consumer_span_with_the_outcome(
    db: Any, spans: InMemorySpanExporter
) -> None:
    event = await save_in_a_span(db, "collection")

    @inbox_guard(Inbox(db, consumer="billing"), max_attempts=2)
    async def bill(event: Event, session: Any) -> None:
        raise ValueError("no such customer")

    first = await bill.handle(event)
    second = await bill.handle(event)
    assert (first.outcome, second.outcome) == (Outcome.RETRY, Outcome.DEAD_LETTERED)
    consumers = [s for s in spans.get_finished_spans() if s.kind is SpanKind.CONSUMER]
    save = one(spans.get_finished_spans(), "checkout")
    assert len(consumers) == 2
    for span, outcome in zip(consumers, ("retry", "dead_lettered"), strict=True):
        # No relay here: the event carries the save's context, and the consumer is its child.
        assert span.parent is not None and span.parent.span_id == save.context.span_id
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes is not None
        assert span.attributes["mongo_outbox.inbox.outcome"] == outcome
    assert [e.name for e in consumers[0].events] == ["exception"]
    assert consumers[0].events[0].attributes is not None
    assert consumers[0].events[0].attributes["exception.type"] == "ValueError"


async def test_an_event_saved_outside_a_span_is_published_in_a_trace_of_its_own(
    db: Any, spans: InMemorySpanExporter
) -> None:
    outbox = make_outbox(db)
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1
    producer = one(spans.get_finished_spans(), "publish")
    assert producer.parent is None
    assert publisher.events[0].headers == {"traceparent": traceparent(producer)}


async def test_trace_headers_that_are_not_a_valid_context_are_published_as_the_caller_set_them(
    db: Any, spans: InMemorySpanExporter
) -> None:
    outbox = make_outbox(db)
    theirs = {"traceparent": "not-a-trace", "tracestate": "vendor=1"}
    with trace.get_tracer("shop").start_as_current_span("checkout"):
        await outbox.save_with_events(
            None, db.orders, {"_id": 1}, [Event(type="placed", headers=theirs)]
        )
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1
    assert publisher.events[0].headers == theirs
    assert one(spans.get_finished_spans(), "publish").parent is None


async def test_a_guard_called_inside_a_framework_s_span_nests_in_it_linked_to_the_message(
    db: Any, spans: InMemorySpanExporter
) -> None:
    event = await save_in_a_span(db, "collection")
    handled: list[Event] = []
    guarded = billing(db, handled)
    with trace.get_tracer("framework").start_as_current_span("framework receive"):
        assert await guarded(event) is True
    finished = spans.get_finished_spans()
    save, framework = one(finished, "checkout"), one(finished, "framework receive")
    consumer = one(finished, "process orders")
    assert consumer.parent is not None and consumer.parent.span_id == framework.context.span_id
    assert [link.context.span_id for link in consumer.links] == [save.context.span_id]
    assert one(finished, "bill").parent.span_id == consumer.context.span_id  # type: ignore[union-attr]


async def test_the_change_stream_relay_publishes_in_producer_spans_too(
    db: Any, spans: InMemorySpanExporter
) -> None:
    outbox = make_outbox(db)
    await outbox.ensure_indexes()
    app = trace.get_tracer("shop")
    with app.start_as_current_span("before"):  # found by the relay's first sweep
        await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")])
    source, publisher = ScriptedSource(), MemoryPublisher()
    relay = ChangeStreamRelay(outbox, publisher, name="orders-relay", source=source)
    task = asyncio.create_task(relay.run())
    try:
        await publisher.wait_for(1)

        async def watching() -> bool:
            return bool(source.opens)

        await until(watching)
        with app.start_as_current_span("after"):  # seen in the change stream
            saved = await outbox.save_with_events(None, db.orders, {"_id": 2}, [Event(type="x")])
        source.play(inserts(await db.outbox.find({"_id": saved.events[0].id}).to_list(), "t1"))
        await publisher.wait_for(2)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    finished = spans.get_finished_spans()
    producers = [s for s in finished if s.kind is SpanKind.PRODUCER]
    assert len(producers) == 2
    for producer, name, sent in zip(producers, ("before", "after"), publisher.events, strict=True):
        save = one(finished, name)
        assert producer.parent is not None and producer.parent.span_id == save.context.span_id
        assert sent.headers == {"traceparent": traceparent(producer)}
