"""The write side of tracing: every write API, in both modes and both APIs, stores the current
span's trace context in its events' headers, never over the caller's own; nothing without a
current span, or without a tracer provider, or without opentelemetry-api at all; and a save
retried after a crash, under another trace, is still the same save."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from pymongo import MongoClient

from mongo_outbox import DuplicateEventError, Event, Inbox, PollingRelay, inbox_guard
from mongo_outbox.publishers import MemoryPublisher
from tests.support.apis import APIS, Writer
from tests.support.outboxes import MODES, make_outbox
from tests.support.servers import MongoServer
from tests.support.tracing import no_provider, one, recorded_spans, traceparent


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with recorded_spans() as exporter:
        yield exporter


async def published(outbox: Any) -> list[Event]:
    """What the relay publishes, as stored: no tracer provider, so no producer span rewrites."""
    publisher = MemoryPublisher()
    with no_provider():
        await PollingRelay(outbox, publisher).drain()
    return publisher.events


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
async def test_every_write_api_stores_the_current_trace_context(
    db: Any, sync_client: MongoClient[Any], spans: InMemorySpanExporter, api: str, mode: str
) -> None:
    writer = Writer(api, db, sync_client, mode=mode, collections=["orders"])
    with trace.get_tracer("shop").start_as_current_span("checkout"):
        saves = [
            await writer.save_with_events(None, db.orders, {"_id": 1}, [Event(type="placed")]),
            await writer.save_with_events(None, db.orders, {"_id": 2}, [Event(type="placed")]),
            await writer.update_with_events(
                None, db.orders, {"_id": 1}, {"$set": {"paid": True}}, [Event(type="paid")]
            ),
        ]
        if mode == "collection":
            saves.append(
                await writer.delete_with_events(None, db.orders, {"_id": 2}, [Event(type="gone")])
            )
            saves.append(await add_events_in_a_transaction(writer, db, sync_client))
    header = traceparent(one(spans.get_finished_spans(), "checkout"))
    expected = 5 if mode == "collection" else 3
    assert [e.headers for saved in saves for e in saved.events] == [{"traceparent": header}] * (
        expected
    )
    stored = await published(writer.relay_outbox)
    assert [e.headers for e in stored] == [{"traceparent": header}] * expected


async def add_events_in_a_transaction(writer: Writer, db: Any, sync_client: Any) -> Any:
    """add_events beside the caller's own write, in the caller's transaction, in ``writer``'s
    API (the sync one in a worker thread, which inherits the current span)."""
    events = [Event(type="noted")]
    if writer.api == "async":
        async with db.client.start_session() as session:
            async with await session.start_transaction():
                await db.orders.update_one({"_id": 1}, {"$set": {"n": 1}}, session=session)
                return await writer.add_events(session, db.orders, 1, events)

    def add() -> Any:
        with sync_client.start_session() as session, session.start_transaction():
            writer.sync_db.orders.update_one({"_id": 1}, {"$set": {"n": 1}}, session=session)
            return writer.outbox.add_events(session, writer.sync_db.orders, 1, events)

    return await asyncio.to_thread(add)


@pytest.mark.parametrize("mode", MODES)
async def test_without_a_current_span_nothing_is_injected(
    db: Any, spans: InMemorySpanExporter, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    saved = await outbox.save_with_events(
        None, db.orders, {"_id": 1}, [Event(type="placed", headers={"tenant": "acme"})]
    )
    assert saved.events[0].headers == {"tenant": "acme"}
    assert [e.headers for e in await published(outbox)] == [{"tenant": "acme"}]


@pytest.mark.parametrize("mode", MODES)
async def test_trace_headers_the_caller_set_win(
    db: Any, spans: InMemorySpanExporter, mode: str
) -> None:
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    events = [
        Event(type="a", headers={"Traceparent": theirs}),
        Event(type="b", headers={"tracestate": "vendor=1"}),
        Event(type="c", headers={"tenant": "acme"}),
    ]
    outbox = make_outbox(db, mode)
    with trace.get_tracer("shop").start_as_current_span("checkout"):
        saved = await outbox.save_with_events(None, db.orders, {"_id": 1}, events)
    ours = traceparent(one(spans.get_finished_spans(), "checkout"))
    expected = [
        {"Traceparent": theirs},
        {"tracestate": "vendor=1"},
        {"tenant": "acme", "traceparent": ours},
    ]
    assert [e.headers for e in saved.events] == expected
    assert [e.headers for e in await published(outbox)] == expected
    # The caller's Event objects are values: they were not changed.
    assert events[2].headers == {"tenant": "acme"}


async def test_a_context_current_without_the_sdk_is_propagated_as_it_is(db: Any) -> None:
    # What a framework that extracted an incoming request's context leaves current.
    context = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
        trace_state=TraceState([("vendor", "v1")]),
    )
    outbox = make_outbox(db)
    with no_provider(), trace.use_span(NonRecordingSpan(context)):
        saved = await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    expected = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=v1",
    }
    assert saved.events[0].headers == expected
    assert [e.headers for e in await published(outbox)] == [expected]


async def test_without_a_tracer_provider_no_headers_are_added_and_everything_works(
    db: Any,
) -> None:
    outbox = make_outbox(db)
    handled: list[Event] = []

    @inbox_guard(Inbox(db, consumer="billing"))
    async def bill(event: Event, session: Any) -> None:
        handled.append(event)

    with no_provider():
        with trace.get_tracer("shop").start_as_current_span("checkout"):
            saved = await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
        publisher = MemoryPublisher()
        assert await PollingRelay(outbox, publisher).drain() == 1
        assert await bill(publisher.events[0]) is True
    assert saved.events[0].headers == {}
    assert [e.headers for e in publisher.events] == [{}]
    assert [e.id for e in handled] == [saved.events[0].id]


async def test_a_save_retried_under_another_trace_after_a_crash_is_the_same_save(
    db: Any, spans: InMemorySpanExporter
) -> None:
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    event = Event(id="order-7-placed", type="placed")  # a chosen id: the save reserves it
    app = trace.get_tracer("shop")
    with app.start_as_current_span("first try"):
        plan = outbox._rules.save(None, db.orders, {"_id": 7}, [event], None)
    # The first try runs until its event ids are reserved, then its process dies.
    steps = outbox._steps(plan, None)
    step = next(steps)
    while step.target is not outbox.event_ids:
        step = steps.send(await getattr(step.target, step.method)(*step.args, **step.kwargs))
    await getattr(step.target, step.method)(*step.args, **step.kwargs)
    steps.close()
    assert await outbox.event_ids.count_documents({"_id": event.id}) == 1
    assert await db.orders.count_documents({}) == 0
    with app.start_as_current_span("retry"):
        saved = await outbox.save_with_events(None, db.orders, {"_id": 7}, [event])
    retry = traceparent(one(spans.get_finished_spans(), "retry"))
    assert plan.events[0].headers != {"traceparent": retry}  # the first try had another
    assert [(e.sequence, e.headers) for e in saved.events] == [(1, {"traceparent": retry})]
    assert [(e.id, e.headers) for e in await published(outbox)] == [
        (event.id, {"traceparent": retry})
    ]


def test_without_opentelemetry_installed_the_library_works(mongo: MongoServer) -> None:
    script = textwrap.dedent(
        """
        import asyncio, sys
        sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
        from pymongo import AsyncMongoClient
        from mongo_outbox import Event, Inbox, Outbox, PollingRelay, inbox_guard, tracing
        from mongo_outbox.publishers import MemoryPublisher

        async def main():
            assert tracing.tracer() is None
            client = AsyncMongoClient(sys.argv[1], tz_aware=True)
            db = client["t_no_otel_" + sys.argv[2]]
            outbox = Outbox(db)
            saved = await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
            publisher = MemoryPublisher()
            assert await PollingRelay(outbox, publisher).drain() == 1

            @inbox_guard(Inbox(db, consumer="billing"))
            async def bill(event, session):
                pass

            assert await bill(publisher.events[0]) is True
            assert [e.headers for e in publisher.events] == [{}] == [saved.events[0].headers]
            await client.drop_database(db.name)
            await client.close()
            print("worked")

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, mongo.uri, str(id(script))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "worked"


async def test_an_event_a_traced_save_returned_is_refused_once_published(
    db: Any, spans: InMemorySpanExporter
) -> None:
    # A traced save stores copies of the events (with the trace context): what it returns must
    # remember the save all the same, or saving it again would publish it a second time.
    outbox = make_outbox(db, "embedded")
    await outbox.ensure_indexes()
    with trace.get_tracer("shop").start_as_current_span("save"):
        saved = await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a")])
    assert len(await published(outbox)) == 1
    again = saved.events[0]
    with pytest.raises(DuplicateEventError, match="published"):
        await outbox.save_with_events(None, db.orders, {"_id": 1}, [again])
    assert await published(outbox) == []


class Broken(Exception):
    pass


@pytest.mark.parametrize("where", ["start_span", "end"])
@pytest.mark.parametrize("batch", [False, True], ids=["publish", "publish_many"])
async def test_a_tracing_sdk_that_fails_does_not_stop_publishing(
    db: Any, where: str, batch: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # The tracer raises on the third span, or a span on its end: the relay publishes
    # everything all the same and says so, once a wave. It used to fail, its other publish
    # workers left running, every event published again after its claim ran out.
    from opentelemetry.sdk.trace import Span, Tracer

    outbox = make_outbox(db, "collection")
    await outbox.ensure_indexes()
    for n in range(6):
        await outbox.save_with_events(None, db.orders, {"_id": n}, [Event(type="t")])
    started = [0]
    start_span, end = Tracer.start_span, Span.end

    def failing_start(self: Any, *args: Any, **kwargs: Any) -> Any:
        started[0] += 1
        if where == "start_span" and started[0] == 3:
            raise Broken("tracer exploded")
        return start_span(self, *args, **kwargs)

    def failing_end(self: Any, *args: Any, **kwargs: Any) -> None:
        if where == "end":
            raise Broken("exporter exploded")
        end(self, *args, **kwargs)

    publisher = MemoryPublisher()
    if not batch:  # a publisher without publish_many: one worker per event in flight
        publisher.publish_many = None  # type: ignore[assignment,method-assign]
    with recorded_spans(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Tracer, "start_span", failing_start)
        patch.setattr(Span, "end", failing_end)
        with caplog.at_level("WARNING", logger="mongo_outbox.tracing"):
            assert await PollingRelay(outbox, publisher).drain() == 6
    assert sorted(e.aggregate_id for e in publisher.events) == list(range(6))
    assert await db.outbox.count_documents({"status": "published"}) == 6
    assert any("tracing failed" in r.getMessage() for r in caplog.records)
