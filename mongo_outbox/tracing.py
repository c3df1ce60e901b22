"""Trace context carried from the save to the consumer, through the OpenTelemetry API.

- **Save.** When a span is current, every write with events (both APIs, both modes) puts its
  W3C ``traceparent`` and ``tracestate`` into each event's headers, which the publishers copy
  onto the broker message. An event whose headers already name either is left as it is: the
  caller's context wins.
- **Relay.** Each publish runs in a ``PRODUCER`` span, the child of the context the event
  carries, with the messaging attributes (system, destination, message id); the message then
  carries the producer span's context instead, in the same trace.
- **Consumer.** ``inbox_guard`` runs each delivery in a ``CONSUMER`` span, the child of the
  context the event carries, and records the handler's exceptions and the outcome.

Only ``opentelemetry-api`` is used (the ``otel`` extra). Without it every function here is a
no-op; the library never configures a tracer provider. The relay and the guard skip the work
when no provider is configured (the API's default proxy): a process without an SDK pays one
look at the provider per relay wave and per delivery, and one at the current span per save.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from mongo_outbox.errors import describe
from mongo_outbox.events import Event

log = logging.getLogger("mongo_outbox.tracing")

try:
    from opentelemetry import trace
    from opentelemetry.trace import (
        Link,
        NoOpTracerProvider,
        ProxyTracerProvider,
        SpanKind,
        StatusCode,
    )
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed: tracing is off
    _ON = False
else:
    _ON = True
    _PROPAGATOR = TraceContextTextMapPropagator()

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

__all__ = ["TRACE_HEADERS", "Publishing", "consuming", "publishing", "stamped", "tracer"]

TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
"""The W3C trace-context header names (compared case-insensitively)."""

_SCOPE = "mongo_outbox"
# The delivery a consumer helper is settling: it knows the broker, which the guard does not.
_delivery: ContextVar[object] = ContextVar("mongo_outbox_delivery", default=None)
_cached: tuple[Any, Any] | None = None  # (provider, its tracer): get_tracer once per provider


def tracer() -> Tracer | None:
    """The library's tracer, or ``None`` when spans would be dropped anyway: no
    ``opentelemetry-api``, or no tracer provider configured. Asking the API costs microseconds
    when none is (it looks at the environment): the relay asks once per wave."""
    global _cached
    if not _ON:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, (ProxyTracerProvider, NoOpTracerProvider)):
        return None
    cached = _cached
    if cached is None or cached[0] is not provider:
        cached = _cached = (provider, provider.get_tracer(_SCOPE))
    found: Tracer = cached[1]
    return found


def _traced(headers: Mapping[str, str]) -> dict[str, str]:
    """The trace-context headers among ``headers``, under their lower-case names."""
    return {name.lower(): value for name, value in headers.items() if name.lower() in TRACE_HEADERS}


def stamped(events: list[Event]) -> list[Event]:
    """``events`` with the current span's trace context in their headers (the write side).

    Runs whether or not a provider is configured: a context that is current (from an SDK, or
    extracted by a framework) is propagated as it is. Events that name a trace header already
    keep their own.
    """
    if not _ON or not events:
        return events
    if not trace.get_current_span().get_span_context().is_valid:
        return events
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return [
        event
        if _traced(event.headers)
        else event.model_copy(update={"headers": event.headers | carrier})
        for event in events
    ]


class Publishing:
    """The producer spans of one publisher call: ``sent`` are the events to hand to the
    publisher (carrying their span's context), ``end`` records each one's result."""

    def __init__(self, spans: list[Span], sent: list[Event]) -> None:
        self.spans = spans
        self.sent = sent

    def end(self, results: Sequence[BaseException | None]) -> None:
        try:
            for span, error in zip(self.spans, results, strict=True):
                if error is not None:
                    span.record_exception(error)
                    span.set_attribute("error.type", type(error).__qualname__)
                    span.set_status(StatusCode.ERROR, describe(error))
                span.end()
        except Exception as failure:  # noqa: BLE001 - the SDK's fault: tracing is not publishing
            _tracing_failed(failure)


def _tracing_failed(failure: Exception) -> None:
    log.warning("tracing failed, publishing goes on without its spans: %s", describe(failure))


def publishing(
    found: Tracer | None, publisher: object, events: Sequence[Event]
) -> Publishing | None:
    """Start a ``PRODUCER`` span of the tracer ``found`` (``tracer()``, asked once for many
    calls) per event, the child of the context the event carries; ``None`` without a tracer,
    or when the tracing SDK fails (publishing goes on without its spans, and says so)."""
    if found is None:
        return None
    try:
        return _publishing(found, publisher, events)
    except Exception as failure:  # noqa: BLE001 - the SDK's fault: tracing is not publishing
        _tracing_failed(failure)
        return None


def _publishing(found: Tracer, publisher: object, events: Sequence[Event]) -> Publishing:
    describe_destination = getattr(publisher, "messaging_attributes", None)
    spans, sent = [], []
    for event in events:
        attributes: dict[str, Any] = {
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.message.id": event.id,
        }
        if event.correlation_id is not None:
            attributes["messaging.message.conversation_id"] = event.correlation_id
        if callable(describe_destination):
            # A destination that cannot be rendered fails the publish itself, which says why.
            with contextlib.suppress(Exception):
                attributes.update(describe_destination(event))
        destination = attributes.get("messaging.destination.name")
        carried = _traced(event.headers)
        parent = _PROPAGATOR.extract(carried)
        span = found.start_span(
            f"publish {destination}" if destination else "publish",
            context=parent,
            kind=SpanKind.PRODUCER,
            attributes=attributes,
        )
        spans.append(span)
        # Headers that are not a valid trace context are the caller's: they stay.
        keep = carried and not trace.get_current_span(parent).get_span_context().is_valid
        sent.append(event if keep else _carrying(event, span))
    return Publishing(spans, sent)


def _carrying(event: Event, span: Span) -> Event:
    """``event`` with ``span``'s context in place of the one it carried (the same trace)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    if not carrier:
        return event
    own = {k: v for k, v in event.headers.items() if k.lower() not in TRACE_HEADERS}
    return event.model_copy(update={"headers": own | carrier})


@contextlib.contextmanager
def consuming(
    event: Event, *, message_id: str, source: str, consumer: str
) -> Iterator[Span | None]:
    """Run a guarded delivery in a ``CONSUMER`` span (current meanwhile, so the handler's own
    spans nest in it), the child of the context ``event`` carries; ``None`` when no tracer
    provider is configured.

    Called inside a span already (a framework that traces its own deliveries), the span is that
    one's child instead, linked to the context the event carries: one trace, not two siblings.
    """
    found = tracer()
    if found is None:
        yield None
        return
    attributes = {
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": message_id,
        "messaging.consumer.group.name": consumer,
    }
    if source:
        attributes["mongo_outbox.inbox.source"] = source
    messaging = getattr(_delivery.get(), "messaging", None)
    if callable(messaging):
        attributes.update(messaging())  # the broker's system and destination
    # Read once: a guard the handler calls itself is not this delivery.
    unset = _delivery.set(None)
    destination = attributes.get("messaging.destination.name") or source
    carried = _PROPAGATOR.extract(_traced(event.headers))
    parent: Context | None = carried  # None: the current context
    links: list[Link] = []
    if trace.get_current_span().get_span_context().is_valid:
        sender = trace.get_current_span(carried).get_span_context()
        parent, links = None, [Link(sender)] if sender.is_valid else []
    with found.start_as_current_span(
        f"process {destination}" if destination else "process",
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
    ) as span:
        try:
            yield span
        finally:
            _delivery.reset(unset)


@contextlib.contextmanager
def receiving(delivery: object) -> Iterator[None]:
    """Consumer spans started inside describe ``delivery``'s broker, from its ``messaging()``
    attributes (a consumer helper's delivery has it)."""
    token = _delivery.set(delivery)
    try:
        yield
    finally:
        _delivery.reset(token)


def outcome(span: Span, name: str, attempt: int, error: str | None) -> None:
    """What became of the delivery, on its consumer span: handled or a duplicate (OK), or to be
    retried or dead-lettered (an error, with why)."""
    span.set_attribute("mongo_outbox.inbox.outcome", name)
    span.set_attribute("mongo_outbox.inbox.attempt", attempt)
    if name in ("retry", "dead_lettered"):
        span.set_status(StatusCode.ERROR, error or name)


def record_failure(error: BaseException) -> None:
    """Record a handler's exception on the current (consumer) span; the guard then decides what
    becomes of the message, and the span's outcome says so."""
    if _ON:
        trace.get_current_span().record_exception(error)
