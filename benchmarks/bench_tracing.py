"""What tracing costs: the relay's publishing engine and the save, without and with a tracer
provider.

The relay side drives ``Rounds.publish_claim`` over a ``MemoryPublisher`` (as
``bench_publishers`` does: no database, no broker, so the library's own CPU is all there is to
measure), alternating three runs: no tracer provider (the baseline: tracing is skipped), the
OpenTelemetry SDK recording every producer span but exporting none, and the SDK exporting each
span to memory. The save side times ``save_with_events`` outside any span and inside one (which
stamps the events' headers). Needs ``opentelemetry-sdk`` (the dev extras); the global tracer
provider is removed again at the end.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.bench_publishers import make_events, relay_driver
from benchmarks.common import client, fresh_db, header, median, say, standalone
from mongo_outbox import Event, Outbox
from mongo_outbox.publishers import MemoryPublisher

MESSAGES = 5000
REPEATS = 5
SAVES = 300


async def relay_rates(mongo: Any) -> dict[str, float]:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.test.globals_test import reset_trace_globals

    def recording() -> None:
        trace.set_tracer_provider(TracerProvider())

    def exporting() -> None:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        trace.set_tracer_provider(provider)

    setups = {"no tracer provider": lambda: None, "SDK, spans recorded": recording}
    setups["SDK, spans exported to memory"] = exporting
    seconds: dict[str, list[float]] = {label: [] for label in setups}
    try:
        for _ in range(REPEATS):
            for label, setup in setups.items():
                reset_trace_globals()
                setup()
                run = relay_driver(MemoryPublisher(), mongo)
                events = make_events(MESSAGES)
                start = time.perf_counter()
                await run(events)
                seconds[label].append(time.perf_counter() - start)
    finally:
        reset_trace_globals()
    return {label: MESSAGES / median(values) for label, values in seconds.items()}


async def save_rates(db: Any) -> dict[str, float]:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.test.globals_test import reset_trace_globals

    outbox = Outbox(db)
    seconds: dict[str, list[float]] = {"no current span": [], "inside a span": []}
    reset_trace_globals()
    trace.set_tracer_provider(TracerProvider())
    tracer = trace.get_tracer("bench")
    try:
        for repeat in range(REPEATS):
            for label, times in seconds.items():
                start = time.perf_counter()
                for n in range(SAVES):
                    document = {"_id": f"{label}-{repeat}-{n}"}
                    if label == "inside a span":
                        with tracer.start_as_current_span("request"):
                            await outbox.save_with_events(
                                None, db.orders, document, [Event(type="placed")]
                            )
                    else:
                        await outbox.save_with_events(
                            None, db.orders, document, [Event(type="placed")]
                        )
                times.append(time.perf_counter() - start)
    finally:
        reset_trace_globals()
    return {label: SAVES / median(values) for label, values in seconds.items()}


def lines_for(what: str, unit: str, rates: dict[str, float]) -> list[str]:
    baseline = next(iter(rates.values()))
    lines = [
        f"{what:<6} {label:<32} {rate:>9,.0f} {unit}  ratio {rate / baseline:.2f}"
        for label, rate in rates.items()
    ]
    for line in lines:
        say(line)
    return lines


async def run(uri: str) -> list[str]:
    header("Tracing: the relay's publishing engine and the save, without and with a provider")
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        say("skipped: needs opentelemetry-sdk (pip install -e '.[dev]')")
        return ["skipped: needs opentelemetry-sdk"]
    say(
        f"relay: {MESSAGES} events through Rounds.publish_claim over MemoryPublisher, median of "
        f"{REPEATS}, ratio to the first line; save: {SAVES} save_with_events of one event"
    )
    mongo = client(uri)
    try:
        lines = lines_for("relay", "msg/s", await relay_rates(mongo))
        async with fresh_db(mongo) as db:
            lines += lines_for("save", "saves/s", await save_rates(db))
    finally:
        await mongo.close()
    return lines


if __name__ == "__main__":
    standalone(run)
