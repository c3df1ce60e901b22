"""The OpenTelemetry SDK for tracing tests: a tracer provider with an in-memory exporter,
installed as the global one for one test and removed afterwards (the SDK lets a process set its
global provider once; its own test helper resets that)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.test.globals_test import reset_trace_globals


@contextmanager
def recorded_spans() -> Iterator[InMemorySpanExporter]:
    """A global tracer provider whose ended spans the yielded exporter keeps."""
    reset_trace_globals()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()
        reset_trace_globals()


@contextmanager
def no_provider() -> Iterator[None]:
    """No tracer provider configured, as in a process without the SDK."""
    reset_trace_globals()
    try:
        yield
    finally:
        reset_trace_globals()


def one(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    """The one span called ``name``."""
    found = [span for span in spans if span.name == name]
    assert len(found) == 1, [span.name for span in spans]
    return found[0]


def traceparent(span: ReadableSpan) -> str:
    """The W3C traceparent header of ``span``."""
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
