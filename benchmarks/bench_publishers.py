"""Publish throughput of each publisher, driven as the relay drives it, against raw clients.

The library side goes through the relay's own publishing engine (``Rounds.publish_claim``): a
wave of one event per aggregate, at most ``max_in_flight`` awaiting a confirmation (NATS and
RabbitMQ: two ``publish_many`` chunks of half that, one sent while the other awaits its acks;
raw aio-pika gets the same window as ``max_in_flight`` concurrent ``exchange.publish``). The
baselines are the broker clients used directly with the same window and the same messages
(subject or routing key, properties, headers), serialised inside the timed run as the library
does, so the ratio is the library's own overhead. Where Go and Debian's amqp091-go are installed
(``apt-get install golang-go golang-github-rabbitmq-amqp091-go-dev``), a Go client
(``benchmarks/go``) publishes the same RabbitMQ messages with the same window, as a reference
for what the broker takes; it reports its own time, from its first publish to its last confirm
(its messages are built before that). Likewise with Debian's nats.go
(``golang-github-nats-io-go-nats-dev``), a Go publisher sends the same NATS messages with
``PublishMsgAsync`` and as many pending, against ``NatsPublisher.publish_many`` through the
public API in chunks of that many, in turn and two half-size chunks at once (as the relay
drives it); without Go the run says so and goes on. Runs alternate baseline and library; each
takes a fresh stream or exchange and queue, deleted afterwards. The end-to-end figure (saved
events, drained to the broker) is mostly the database's cost, and here that is whatever
MongoDB the benchmark runs on.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.common import (
    NATS_URL,
    RABBITMQ_URL,
    client,
    fresh_db,
    header,
    median,
    say,
    standalone,
    unique,
)
from mongo_outbox import Event, Outbox, PollingRelay, RelaySettings
from mongo_outbox._relay.rounds import Rounds
from mongo_outbox._relay.store.base import Claim
from mongo_outbox.brokers._publishing import message_headers
from mongo_outbox.publishers import MemoryPublisher, Publisher

MESSAGES = 5000
IN_FLIGHT = 256
REPEATS = 5
E2E_AGGREGATES = 250
E2E_EVENTS_PER_AGGREGATE = 2

GO_SOURCES = os.path.join(os.path.dirname(__file__), "go")
GO_LIBRARIES = "/usr/share/gocode"  # where Debian's golang-*-dev packages put their sources

# A run returns None, or the seconds it measured itself (a client in another process).
Run = Callable[[list[Event]], Awaitable[float | None]]


def make_events(count: int) -> list[Event]:
    # One event per aggregate: every publish can be in flight at once, as for the baselines.
    return [
        Event(
            type="order.placed",
            payload={"order": n, "customer": f"customer-{n % 97}", "lines": [1, 2, 3] * 8},
            aggregate_type="orders",
            aggregate_id=f"order-{n}",
            sequence=1,
        )
        for n in range(count)
    ]


def relay_driver(publisher: Publisher, mongo: Any) -> Run:
    # The relay's publishing engine alone: its outbox is never touched, no claim is written.
    settings = RelaySettings(max_in_flight=IN_FLIGHT)
    rounds = Rounds(Outbox(mongo.bench_unused), publisher, settings)

    async def run(events: list[Event]) -> None:
        claim = Claim("bench", tuple((event,) for event in events))
        published, failed, _ = await rounds.publish_claim(claim)
        if failed or len(published) != len(events):
            raise RuntimeError(f"{len(failed)} publishes failed: {failed[0].error}")

    return run


async def bounded(count: int, send: Callable[[int], Awaitable[Any]]) -> None:
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one(i: int) -> None:
        async with slots:
            await send(i)

    await asyncio.gather(*(one(i) for i in range(count)))


async def compare(
    name: str,
    runs: dict[str, Callable[[], Awaitable[Run]]],
    cleanup: Callable[[], Awaitable[None]],
    reference: str | None = None,
) -> list[str]:
    """Time each run REPEATS times, alternating, with fresh events each time (brokers dedupe);
    the ratios are the library's to each other run, or with ``reference`` each run's to it."""
    seconds: dict[str, list[float]] = {label: [] for label in runs}
    try:
        for _ in range(REPEATS):
            for label, prepare in runs.items():
                events = make_events(MESSAGES)
                run = await prepare()
                start = time.perf_counter()
                measured = await run(events)
                elapsed = time.perf_counter() - start
                seconds[label].append(elapsed if measured is None else measured)
    finally:
        await cleanup()
    rates = {label: MESSAGES / median(values) for label, values in seconds.items()}
    if reference is not None:
        # Each run against one reference (a client in another language, say).
        base = rates.pop(reference)
        lines = [f"{name:<9} {reference} {base:>9,.0f} msg/s"]
        for label, rate in rates.items():
            lines.append(f"{name:<9}   {label:<53} {rate:>9,.0f} msg/s  ratio {rate / base:.2f}")
        for line in lines:
            say(line)
        return lines
    library = rates.pop("library")
    lines = [f"{name:<9} library {library:>9,.0f} msg/s"]
    for label, rate in rates.items():
        lines.append(f"{name:<9}   vs {label:<50} {rate:>9,.0f} msg/s  ratio {library / rate:.2f}")
    for line in lines:
        say(line)
    return lines


async def bench_memory(mongo: Any) -> list[str]:
    async def library() -> Run:
        return relay_driver(MemoryPublisher(), mongo)

    async def nothing() -> None:
        pass

    return await compare("memory", {"library": library}, nothing)


async def bench_nats(mongo: Any) -> list[str]:
    import nats

    from mongo_outbox.publishers import NatsPublisher

    nc = await nats.connect(NATS_URL, connect_timeout=5, max_reconnect_attempts=1)
    js = nc.jetstream()
    js_async = nc.jetstream(publish_async_max_pending=IN_FLIGHT)
    streams: list[str] = []

    async def stream() -> str:
        name = unique("bench")
        await js.add_stream(name=name, subjects=[f"{name}.>"])
        streams.append(name)
        return name

    def raw_messages(name: str, events: list[Event]) -> list[tuple[str, bytes, dict[str, str]]]:
        return [
            (
                f"{name}.orders.order.placed",
                e.model_dump_json().encode(),
                message_headers(e) | {"Nats-Msg-Id": e.id, "Content-Type": "application/json"},
            )
            for e in events
        ]

    async def library() -> Run:
        publisher = NatsPublisher(js, subject=f"{await stream()}.{{aggregate_type}}.{{type}}")
        return relay_driver(publisher, mongo)

    async def raw_publish() -> Run:
        name = await stream()

        async def run(events: list[Event]) -> None:
            messages = raw_messages(name, events)

            async def send(i: int) -> None:
                subject, payload, headers = messages[i]
                await js.publish(subject, payload, headers=headers)

            await bounded(len(messages), send)

        return run

    async def raw_publish_async() -> Run:
        name = await stream()

        async def run(events: list[Event]) -> None:
            messages = raw_messages(name, events)
            # publish_async itself holds at most IN_FLIGHT messages awaiting their ack.
            acks = [
                await js_async.publish_async(subject, payload, headers=headers)
                for subject, payload, headers in messages
            ]
            await asyncio.gather(*acks)

        return run

    async def cleanup() -> None:
        try:
            for name in streams:
                await js.delete_stream(name)
        finally:
            await nc.close()

    return await compare(
        "nats",
        {
            "library": library,
            f"raw js.publish, {IN_FLIGHT} in flight": raw_publish,
            f"raw js.publish_async, {IN_FLIGHT} pending": raw_publish_async,
        },
        cleanup,
    )


async def bench_rabbitmq(mongo: Any) -> list[str]:
    import aio_pika

    from mongo_outbox.publishers import RabbitMQPublisher

    connection = await aio_pika.connect_robust(RABBITMQ_URL, timeout=5)
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    created: list[tuple[Any, Any]] = []

    async def exchange() -> Any:
        # A durable queue bound to everything, so mandatory persistent messages are routed
        # and written as they would be in production.
        declared = await channel.declare_exchange(
            unique("bench"), aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(unique("bench"), durable=True)
        await queue.bind(declared, "#")
        created.append((declared, queue))
        return declared

    async def library() -> Run:
        return relay_driver(RabbitMQPublisher(await exchange()), mongo)

    async def raw_publish() -> Run:
        declared = await exchange()

        async def run(events: list[Event]) -> None:
            messages = [(e.model_dump_json().encode(), e, message_headers(e)) for e in events]

            async def send(i: int) -> None:
                # The message the publisher sends: the same properties and headers.
                body, e, headers = messages[i]
                message = aio_pika.Message(
                    body,
                    message_id=e.id,
                    type=e.type,
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    timestamp=e.occurred_at,
                    correlation_id=e.correlation_id,
                    headers=dict(headers),
                )
                await declared.publish(message, routing_key=e.type, mandatory=True)

            await bounded(len(messages), send)

        return run

    async def cleanup() -> None:
        try:
            for declared, queue in created:
                await queue.delete(if_unused=False, if_empty=False)
                await declared.delete()
        finally:
            await connection.close()

    runs: dict[str, Callable[[], Awaitable[Run]]] = {
        "library": library,
        f"raw exchange.publish, confirms, {IN_FLIGHT} in flight": raw_publish,
    }
    go = await asyncio.to_thread(build_go_publisher)
    if isinstance(go, str):
        say(f"rabbitmq  (no Go baseline: {go})")
    else:

        async def go_publish() -> Run:
            declared = await exchange()

            async def run(events: list[Event]) -> float:
                return await go_run(go, declared.name, events)

            return run

        runs[f"Go amqp091-go, confirms, {IN_FLIGHT} in flight"] = go_publish
    try:
        return await compare("rabbitmq", runs, cleanup)
    finally:
        if not isinstance(go, str):
            shutil.rmtree(go[1], ignore_errors=True)


def build_go_publisher(
    program: str = "amqppublish", library: str = "github.com/rabbitmq/amqp091-go"
) -> tuple[str, str] | str:
    """The Go publisher ``program`` (a folder of ``benchmarks/go/src``) built in a directory of
    its own (its path and that directory), or why it cannot be."""
    go = shutil.which("go")
    if go is None:
        return "go is not installed (apt-get install golang-go)"
    if not os.path.isdir(os.path.join(GO_LIBRARIES, "src", library)):
        package = {
            "github.com/rabbitmq/amqp091-go": "golang-github-rabbitmq-amqp091-go-dev",
            "github.com/nats-io/nats.go": "golang-github-nats-io-go-nats-dev",
        }.get(library, library)
        return f"{library} is not installed (apt-get install {package})"
    out = tempfile.mkdtemp(prefix="bench-go-")
    binary = os.path.join(out, program)
    environment = os.environ | {
        "GO111MODULE": "off",  # Debian's packages are a GOPATH, not modules
        "GOPATH": f"{GO_SOURCES}{os.pathsep}{GO_LIBRARIES}",
        "GOCACHE": os.path.join(out, "cache"),
    }
    built = subprocess.run(
        [go, "build", "-o", binary, program],
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode:
        shutil.rmtree(out, ignore_errors=True)
        return f"go build failed: {built.stderr.strip()[:200]}"
    return binary, out


async def bench_nats_go(mongo: Any) -> list[str]:
    """``NatsPublisher.publish_many`` in chunks of ``IN_FLIGHT``, through the public API,
    against Go's nats.go publishing the same messages with ``PublishMsgAsync`` and as many
    pending."""
    import nats

    from mongo_outbox.publishers import NatsPublisher

    go = await asyncio.to_thread(build_go_publisher, "natspublish", "github.com/nats-io/nats.go")
    if isinstance(go, str):
        line = f"nats-go   no Go baseline: {go}"
        say(line)
        return [line]
    nc = await nats.connect(NATS_URL, connect_timeout=5, max_reconnect_attempts=1)
    js = nc.jetstream()
    streams: list[str] = []

    async def stream() -> str:
        name = unique("bench")
        await js.add_stream(name=name, subjects=[f"{name}.>"])
        streams.append(name)
        return name

    async def library() -> Run:
        publisher = NatsPublisher(js, subject=f"{await stream()}.{{aggregate_type}}.{{type}}")

        async def run(events: list[Event]) -> None:
            for start in range(0, len(events), IN_FLIGHT):
                results = await publisher.publish_many(events[start : start + IN_FLIGHT])
                if any(results):
                    raise RuntimeError(f"publish_many failed: {next(r for r in results if r)}")

        return run

    async def pipelined() -> Run:
        publisher = NatsPublisher(js, subject=f"{await stream()}.{{aggregate_type}}.{{type}}")
        half = IN_FLIGHT // 2
        turns = asyncio.Semaphore(2)

        async def chunk(events: list[Event]) -> None:
            async with turns:
                results = await publisher.publish_many(events)
            if any(results):
                raise RuntimeError(f"publish_many failed: {next(r for r in results if r)}")

        async def run(events: list[Event]) -> None:
            # As the relay drives it: two chunks of half the window, one sent while the other
            # awaits its acks.
            await asyncio.gather(
                *(chunk(events[start : start + half]) for start in range(0, len(events), half))
            )

        return run

    async def go_publish() -> Run:
        name = await stream()

        async def run(events: list[Event]) -> float:
            lines = "".join(
                json.dumps(
                    {
                        "subject": f"{name}.orders.order.placed",
                        "body": e.model_dump_json(),
                        "headers": message_headers(e)
                        | {"Nats-Msg-Id": e.id, "Content-Type": "application/json"},
                    }
                )
                + "\n"
                for e in events
            )
            return await go_process(go, lines, f"-url={NATS_URL}", f"-window={IN_FLIGHT}")

        return run

    async def cleanup() -> None:
        try:
            for name in streams:
                await js.delete_stream(name)
        finally:
            await nc.close()
            shutil.rmtree(go[1], ignore_errors=True)

    go_label = f"Go nats.go PublishMsgAsync, {IN_FLIGHT} pending"
    return await compare(
        "nats-go",
        {
            go_label: go_publish,
            f"library publish_many, chunks of {IN_FLIGHT} in turn": library,
            f"library publish_many, 2 chunks of {IN_FLIGHT // 2} at once": pipelined,
        },
        cleanup,
        reference=go_label,
    )


async def go_process(go: tuple[str, str], lines: str, *arguments: str) -> float:
    """Run the Go publisher on ``lines``; the seconds it took, as it measured them."""
    process = await asyncio.create_subprocess_exec(
        go[0],
        *arguments,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate(lines.encode())
    if process.returncode:
        raise RuntimeError(f"the Go publisher failed: {err.decode()[:300]}")
    return float(out)


async def go_run(go: tuple[str, str], exchange: str, events: list[Event]) -> float:
    """Publish ``events`` through the Go client; the seconds it took, as it measured them."""
    lines = "".join(
        json.dumps(
            {
                "key": e.type,
                "body": e.model_dump_json(),
                "message_id": e.id,
                "type": e.type,
                "timestamp": int(e.occurred_at.timestamp()),
                "correlation_id": e.correlation_id or "",
                "headers": message_headers(e),
            }
        )
        + "\n"
        for e in events
    )
    return await go_process(
        go, lines, f"-url={RABBITMQ_URL}", f"-exchange={exchange}", f"-window={IN_FLIGHT}"
    )


async def end_to_end(uri: str, mode: str, name: str, connect: Callable[[], Awaitable[Any]]) -> str:
    """Save events, then time one drain of them all to the broker."""
    mongo = client(uri)
    publisher, cleanup = await connect()
    try:
        async with fresh_db(mongo) as db:
            outbox = (
                Outbox(db, mode="embedded", collections=["orders"])
                if mode == "embedded"
                else Outbox(db)
            )
            await outbox.ensure_indexes()
            for n in range(E2E_AGGREGATES):
                events = [
                    Event(type="order.placed", payload={"n": n, "step": step})
                    for step in range(E2E_EVENTS_PER_AGGREGATE)
                ]
                await outbox.save_with_events(None, db.orders, {"_id": f"o{n}", "n": n}, events)
            relay = PollingRelay(outbox, publisher, settings=RelaySettings(batch_size=100))
            start = time.perf_counter()
            published = await relay.drain()
            elapsed = time.perf_counter() - start
    finally:
        await publisher.aclose()
        await cleanup()
        await mongo.close()
    expected = E2E_AGGREGATES * E2E_EVENTS_PER_AGGREGATE
    if published != expected:
        raise RuntimeError(f"end to end {mode}/{name}: drained {published} of {expected}")
    line = (
        f"end-to-end {mode:<10} -> {name:<8} {published} events in {elapsed:.2f}s = "
        f"{published / elapsed:,.0f} events/s"
    )
    say(line)
    return line


async def memory_target() -> tuple[Publisher, Callable[[], Awaitable[None]]]:
    async def nothing() -> None:
        pass

    return MemoryPublisher(), nothing


async def nats_target() -> tuple[Publisher, Callable[[], Awaitable[None]]]:
    import nats

    from mongo_outbox.publishers import NatsPublisher

    name = unique("bench")
    admin = await nats.connect(NATS_URL, connect_timeout=5, max_reconnect_attempts=1)

    async def cleanup() -> None:
        try:
            await admin.jetstream().delete_stream(name)
        finally:
            await admin.close()

    try:
        await admin.jetstream().add_stream(name=name, subjects=[f"{name}.>"])
        publisher = await NatsPublisher.connect(NATS_URL, subject=f"{name}.{{aggregate_type}}")
    except BaseException:
        await cleanup()
        raise
    return publisher, cleanup


async def rabbitmq_target() -> tuple[Publisher, Callable[[], Awaitable[None]]]:
    import aio_pika

    from mongo_outbox.publishers import RabbitMQPublisher

    name = unique("bench")
    admin = await aio_pika.connect_robust(RABBITMQ_URL, timeout=5)

    async def cleanup() -> None:
        try:
            channel = await admin.channel()
            await channel.queue_delete(name)
            await channel.exchange_delete(name)
        finally:
            await admin.close()

    try:
        channel = await admin.channel()
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(name, durable=True)
        await queue.bind(exchange, "#")
        publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=name)
    except BaseException:
        await cleanup()
        raise
    return publisher, cleanup


async def run(uri: str) -> list[str]:
    header(f"Publish throughput: {MESSAGES} messages, {IN_FLIGHT} in flight, median of {REPEATS}")
    say("library = the relay's publishing engine over the publisher; ratio = library / baseline")
    lines: list[str] = []
    mongo = client(uri)
    try:
        for name, bench in (
            ("memory", bench_memory),
            ("nats", bench_nats),
            ("nats-go", bench_nats_go),
            ("rabbitmq", bench_rabbitmq),
        ):
            try:
                lines += await bench(mongo)
            except Exception as error:  # noqa: BLE001 - one broker down must not stop the rest
                lines.append(f"{name}: FAILED ({error!r})")
                say(lines[-1])
    finally:
        await mongo.close()
    header(
        f"End-to-end relay throughput: {E2E_AGGREGATES * E2E_EVENTS_PER_AGGREGATE} saved events, "
        "drain(batch_size=100)"
    )
    say("note: bounded by the MongoDB backend above (the emulator is far slower than mongod)")
    for mode in ("collection", "embedded"):
        for name, target in (
            ("memory", memory_target),
            ("nats", nats_target),
            ("rabbitmq", rabbitmq_target),
        ):
            try:
                lines.append(await end_to_end(uri, mode, name, target))
            except Exception as error:  # noqa: BLE001 - one broker down must not stop the rest
                lines.append(f"end-to-end {mode} -> {name}: FAILED ({error!r})")
                say(lines[-1])
    return lines


if __name__ == "__main__":
    standalone(run)
