"""Ordered mode: one message in flight per aggregate, the others going on; a retry holds the
later messages of its aggregate; a slow message does not stall the fetch loop."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import aio_pika
import pytest

from mongo_outbox import Backoff, Event, Inbox, inbox_guard
from mongo_outbox.consumers import consume_nats, consume_rabbitmq
from mongo_outbox.publishers import NatsPublisher, RabbitMQPublisher
from tests.support.messages import pull
from tests.support.servers import NATS_URL, RABBITMQ_URL

AGGREGATES = 5
EVENTS_PER_AGGREGATE = 6


def history() -> list[Event]:
    """Five aggregates' events, published interleaved: a0 #1, a1 #1, ..., a0 #2, ..."""
    return [
        Event(type="order.changed", aggregate_type="orders", aggregate_id=a, sequence=s)
        for s in range(1, EVENTS_PER_AGGREGATE + 1)
        for a in range(AGGREGATES)
    ]


class Ledger:
    """A handler that takes a random while, fails some events on their first attempt, and
    records the order in which each aggregate's events were handled."""

    def __init__(self, db: Any, flaky: set[str], *, max_attempts: int = 5) -> None:
        self.handled: dict[Any, list[int]] = defaultdict(list)
        self.in_flight: dict[Any, int] = defaultdict(int)
        self.overlaps = 0  # two events of one aggregate handled at once
        self.concurrent = 0
        self.most_concurrent = 0
        self.random = random.Random(7)

        @inbox_guard(
            # Leased mode: the emulator runs transactions safely only one at a time.
            Inbox(db, consumer="ledger", transactional=False),
            max_attempts=max_attempts,
            backoff=Backoff(initial=0.05, maximum=0.1),
        )
        async def record(event: Event, session: Any, *, attempt: int) -> None:
            self.in_flight[event.aggregate_id] += 1
            self.overlaps += self.in_flight[event.aggregate_id] > 1
            self.concurrent += 1
            self.most_concurrent = max(self.most_concurrent, self.concurrent)
            try:
                await asyncio.sleep(self.random.uniform(0, 0.02))
                if event.id in flaky and attempt == 1:
                    raise ConnectionError("ledger busy")
                assert event.sequence is not None
                self.handled[event.aggregate_id].append(event.sequence)
            finally:
                self.in_flight[event.aggregate_id] -= 1
                self.concurrent -= 1

        self.guarded = record

    def count(self) -> int:
        return sum(map(len, self.handled.values()))


@contextlib.asynccontextmanager
async def consuming(consumer: Awaitable[None], stop: asyncio.Event) -> AsyncIterator[Any]:
    task = asyncio.create_task(consumer)
    try:
        yield task
    finally:
        stop.set()
        with contextlib.suppress(asyncio.TimeoutError):  # wait_for cancelled it
            await asyncio.wait_for(task, 10)


def skip_on_nats_2_9(nats_client: Any) -> None:
    """For a test that naks two messages with a delay after a fetch timed out."""
    version = nats_client.connected_server_version
    if (version.major, version.minor) <= (2, 9):
        pytest.skip(
            f"nats-server {version.major}.{version.minor}: 2.9.10 redelivers the wrong "
            "message after a delayed nak now and then (tests/support/nats_delayed_nak.py, "
            "with nats-py alone); the testing extra's nats-server, which .ci/run uses, does not"
        )


async def until(condition: Any, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def in_order() -> dict[int, list[int]]:
    return {a: list(range(1, EVENTS_PER_AGGREGATE + 1)) for a in range(AGGREGATES)}


async def test_rabbitmq_ordered_mode_keeps_each_aggregate_in_order(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    events = history()
    channel = await amqp_connection.channel()
    await channel.set_qos(prefetch_count=100)
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(exclusive=True)
    await queue.bind(exchange, "#")
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    for event in events:
        await publisher.publish(event)
    await publisher.aclose()
    # The second event of aggregate 0 fails once: the later ones of aggregate 0 must wait.
    ledger = Ledger(db, flaky={events[AGGREGATES].id})
    stop = asyncio.Event()
    async with consuming(consume_rabbitmq(queue, ledger.guarded, ordered=True, stop=stop), stop):
        await until(lambda: ledger.count() == len(events))
    assert dict(ledger.handled) == in_order()
    assert ledger.overlaps == 0
    assert ledger.most_concurrent > 1  # the other aggregates went on meanwhile
    await exchange.delete()
    await channel.close()


@pytest.mark.parametrize("batch", [1, 32])
async def test_nats_ordered_mode_keeps_each_aggregate_in_order(
    db: Any, nats_client: Any, nats_stream: str, batch: int
) -> None:
    events = history()
    js = nats_client.jetstream()
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    for event in events:
        await publisher.publish(event)
    await publisher.aclose()
    ledger = Ledger(db, flaky={events[AGGREGATES].id})
    stop = asyncio.Event()
    consumer = consume_nats(
        js,
        f"{nats_stream}.>",
        "ledger",
        ledger.guarded,
        stream=nats_stream,
        ordered=True,
        batch=batch,
        max_in_flight=32,
        stop=stop,
    )
    async with consuming(consumer, stop):
        await until(lambda: ledger.count() == len(events))
    assert dict(ledger.handled) == in_order()
    assert ledger.overlaps == 0
    assert ledger.most_concurrent > 1
    info = await js.consumer_info(nats_stream, "ledger")
    assert info.num_pending == 0 and info.num_ack_pending == 0


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
async def test_one_slow_message_does_not_hold_back_the_ones_fetched_after_it(
    db: Any, nats_client: Any, nats_stream: str, ordered: bool
) -> None:
    js = nats_client.jetstream()
    events = [
        Event(type="order.placed", aggregate_type="orders", aggregate_id=n) for n in range(21)
    ]
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    for event in events:
        await publisher.publish(event)
    await publisher.aclose()
    slow = events[0].id
    release = asyncio.Event()
    handled: list[str] = []

    @inbox_guard(Inbox(db, consumer="c", transactional=False))
    async def handler(event: Event, session: Any) -> None:
        if event.id == slow:
            await release.wait()
        handled.append(event.id)

    stop = asyncio.Event()
    consumer = consume_nats(
        js,
        f"{nats_stream}.>",
        "c",
        handler,
        stream=nats_stream,
        ordered=ordered,
        batch=4,
        stop=stop,
    )
    async with consuming(consumer, stop):
        # Twenty later messages come in fetches of their own while the slow one runs.
        await until(lambda: len(handled) == 20, seconds=10)
        assert slow not in handled
        release.set()
        await until(lambda: len(handled) == 21)


async def test_stopping_ordered_consume_nats_gives_the_held_and_waiting_messages_back(
    db: Any, nats_client: Any, nats_stream: str
) -> None:
    """Aggregate 1's first event is being retried (in the process, up to 300 s); its second
    waits behind it. Stop returns at once, neither is handled, and JetStream has both again."""
    skip_on_nats_2_9(nats_client)
    js = nats_client.jetstream()
    first, second = (
        Event(type="order.changed", aggregate_type="orders", aggregate_id=1, sequence=s)
        for s in (1, 2)
    )
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    await publisher.publish(first)
    await publisher.publish(second)
    await publisher.aclose()
    handled: list[int | None] = []

    @inbox_guard(Inbox(db, consumer="c", transactional=False), backoff=Backoff(initial=300))
    async def handler(event: Event, session: Any) -> None:
        if event.id == first.id:
            raise ConnectionError("ledger busy")
        handled.append(event.sequence)

    async def first_failed() -> bool:
        return await db.inbox.count_documents({"status": "retrying"}) == 1

    stop = asyncio.Event()
    subject = f"{nats_stream}.>"
    consumer = consume_nats(js, subject, "c", handler, stream=nats_stream, ordered=True, stop=stop)
    async with consuming(consumer, stop) as task:
        deadline = time.monotonic() + 10
        while not await first_failed():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        started = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 10)
        assert time.monotonic() - started < 1.0
    assert handled == []
    # JetStream has both again: the next consumer of the durable gets and handles both (under
    # an inbox consumer name of its own: the first one's record of the first event says retry
    # in 300 s).
    again = asyncio.Event()

    @inbox_guard(Inbox(db, consumer="c-next", transactional=False))
    async def next_handler(event: Event, session: Any) -> None:
        handled.append(event.sequence)

    next_consumer = consume_nats(
        js, subject, "c", next_handler, stream=nats_stream, ordered=True, stop=again
    )
    async with consuming(next_consumer, again):
        await until(lambda: len(handled) == 2, 10)
    assert sorted(handled) == [1, 2]


@pytest.mark.parametrize("ordered", [False, True])
async def test_a_consumer_cancelled_while_a_handler_hangs_leaves_nothing_running_or_held(
    db: Any, nats_client: Any, nats_stream: str, ordered: bool
) -> None:
    # The caller stops the consumer but will not wait for a handler that hangs: the consumer
    # is cancelled during its drain. The handler ends, its keep-alive too, and the message goes
    # back at once: it used to be renewed for as long as the process lived.
    js = nats_client.jetstream()
    skip_on_nats_2_9(nats_client)  # both are nak'ed with a delay after a fetch timed out
    # Two of one aggregate: in ordered mode the second waits its turn behind the first.
    events = [Event(type="order.placed", aggregate_type="orders", aggregate_id=1) for _ in "ab"]
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    for event in events:
        await publisher.publish(event)
    await publisher.aclose()
    started, ended = asyncio.Event(), asyncio.Event()

    @inbox_guard(Inbox(db, consumer="c", transactional=False))
    async def hangs(event: Event, session: Any) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    before = asyncio.all_tasks()
    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_nats(
            js, f"{nats_stream}.>", "c", hangs, stream=nats_stream, ordered=ordered, stop=stop
        )
    )
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    with pytest.raises(asyncio.TimeoutError):  # wait_for cancels it
        await asyncio.wait_for(task, 0.5)
    await asyncio.sleep(0)
    left = {t.get_coro().__qualname__ for t in asyncio.all_tasks() - before}  # type: ignore[union-attr]
    assert not left & {"Dispatcher._run", "_keep_alive"}, left
    assert ended.is_set()  # the handler was cancelled, not left hanging
    # Given back (a nak, due again a second later), not held until the process ends.
    again = await js.pull_subscribe(f"{nats_stream}.>", durable="c", stream=nats_stream)
    # (Both due a second after their nak: one fetch may come between the two.)
    messages = await pull(again, 2, within=10)
    assert sorted(m.metadata.num_delivered for m in messages) == [2, 2]
    for message in messages:
        await message.ack()


@pytest.mark.parametrize("ordered", [False, True])
async def test_a_consumer_cancelled_before_its_drain_cancels_a_hanging_handler(
    db: Any, nats_client: Any, nats_stream: str, ordered: bool
) -> None:
    # Cancelled in its read loop (in a fetch), the consumer drained in its finally block,
    # waiting for the hanging handler: no second cancellation was coming, so it never ended
    # (the cause of a CI run's 120 s timeout of the test above, whose wait_for cancelled the
    # consumer now during its drain, now while it still fetched).
    js = nats_client.jetstream()
    event = Event(type="order.placed", aggregate_type="orders", aggregate_id=1)
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    await publisher.publish(event)
    await publisher.aclose()
    started, ended = asyncio.Event(), asyncio.Event()

    @inbox_guard(Inbox(db, consumer="c", transactional=False))
    async def hangs(event: Event, session: Any) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    task = asyncio.create_task(
        consume_nats(js, f"{nats_stream}.>", "c", hangs, stream=nats_stream, ordered=ordered)
    )
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.sleep(0.1)  # back in its loop, waiting on a fetch
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=15)
    assert done, "the cancelled consumer waited for its hanging handler"
    assert task.cancelled() and ended.is_set()
