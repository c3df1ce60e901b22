"""The relay end to end: saved with ``save_with_events``, drained by ``PollingRelay``, read back
from a real NATS stream or RabbitMQ queue; and what happens while the broker refuses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from mongo_outbox import Backoff, Event, Outbox, PollingRelay, RelaySettings
from mongo_outbox.publishers import NatsPublisher, Publisher, RabbitMQPublisher
from tests.integration.test_publishers import (
    assert_in_aggregate_order,
    bind_queue,
    drain_queue,
    read_stream,
)
from tests.support.servers import NATS_URL, RABBITMQ_URL

MODES = ["collection", "embedded"]
RETRY_FAST = Backoff(initial=0.01, maximum=0.05)
ONE_ATTEMPT = RelaySettings(publish_timeout=5, backoff=RETRY_FAST, max_attempts=1)


def make_outbox(db: Any, mode: str) -> Outbox:
    if mode == "embedded":
        return Outbox(db, mode="embedded", collections=["orders"])
    return Outbox(db)


async def save_history(outbox: Outbox, db: Any, orders: int, saves: int) -> list[Event]:
    """``saves`` saves of each order, two events each, interleaved across orders."""
    committed: list[Event] = []
    for step in range(saves):
        for order in range(orders):
            saved = await outbox.save_with_events(
                None,
                db.orders,
                {"_id": order, "step": step},
                [Event(type="order.changed", payload={"step": step}), Event(type="order.noted")],
            )
            committed += saved.events
    return committed


async def save_and_abort(client: Any, outbox: Outbox, db: Any) -> None:
    """Events of a new and of an existing order, in a transaction aborted on purpose."""
    async with client.start_session() as session:
        with pytest.raises(RuntimeError):
            async with await session.start_transaction():
                for order in (0, 99):
                    await outbox.save_with_events(
                        session, db.orders, {"_id": order}, [Event(type="order.aborted")]
                    )
                raise RuntimeError("abort on purpose")


async def unsettled(outbox: Outbox, db: Any) -> list[dict[str, Any]]:
    """Outbox entries not yet published, in either mode."""
    if outbox.mode == "collection":
        entries: list[dict[str, Any]] = await db.outbox.find(
            {"status": {"$ne": "published"}}
        ).to_list(None)
        return entries
    return [entry async for doc in db.orders.find() for entry in doc.get("_outbox", [])]


async def drain_until(relay: PollingRelay, expected: int, rounds: int = 200) -> int:
    """Drain until ``expected`` events went out, waiting out retry delays between rounds."""
    published = 0
    for _ in range(rounds):
        published += await relay.drain()
        if published >= expected:
            break
        await asyncio.sleep(0.02)
    return published


Reader = Callable[[int], Awaitable[list[Event]]]


@pytest.mark.parametrize("broker", ["nats", "rabbitmq"])
@pytest.mark.parametrize("mode", MODES)
async def test_every_saved_event_arrives_once_in_aggregate_order(
    client: Any,
    db: Any,
    nats_client: Any,
    nats_stream: str,
    channel: Any,
    unique: str,
    mode: str,
    broker: str,
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    committed = await save_history(outbox, db, orders=12, saves=3)
    await save_and_abort(client, outbox, db)
    publisher: Publisher
    if broker == "nats":
        publisher = await NatsPublisher.connect(
            NATS_URL, subject=f"{nats_stream}.{{aggregate_type}}.{{type}}"
        )
    else:
        queue = await bind_queue(channel, unique, "order.*")
        publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    relay = PollingRelay(
        outbox, publisher, settings=RelaySettings(batch_size=16)
    )  # several rounds, several waves
    try:
        assert await relay.drain() == len(committed)
        assert await relay.drain() == 0
    finally:
        await publisher.aclose()
    assert (relay.stats.published, relay.stats.failed) == (len(committed), 0)
    assert await unsettled(outbox, db) == []
    if broker == "nats":
        messages = await read_stream(nats_client, nats_stream, len(committed))
        assert all(m.headers["Nats-Msg-Id"] == Event.from_json(m.data).id for m in messages)
        received = [Event.from_json(m.data) for m in messages]
    else:
        messages = await drain_queue(queue, len(committed))
        assert all(m.message_id == Event.from_json(m.body).id for m in messages)
        received = [Event.from_json(m.body) for m in messages]
    assert_in_aggregate_order(received, committed)  # exactly once; the aborted ones never
    for order in range(12):
        assert [e.sequence for e in received if e.aggregate_id == order] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("mode", MODES)
async def test_relay_backs_off_while_a_stream_is_missing_then_delivers_in_order(
    db: Any, nats_client: Any, unique: str, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    committed = await save_history(outbox, db, orders=6, saves=2)
    js = nats_client.jetstream()
    # Even orders go to a stream that exists, odd ones to one that does not yet.
    await js.add_stream(name=f"{unique}even", subjects=[f"{unique}even.>"])
    publisher = await NatsPublisher.connect(
        NATS_URL,
        subject=lambda e: f"{unique}{'odd' if int(e.aggregate_id or 0) % 2 else 'even'}.{e.type}",
    )
    # One attempt would park an entry: a missing stream is an outage, it must park nothing.
    relay = PollingRelay(outbox, publisher, settings=ONE_ATTEMPT)
    try:
        even = [e for e in committed if int(e.aggregate_id or 0) % 2 == 0]
        odd = [e for e in committed if int(e.aggregate_id or 0) % 2]
        assert await relay.drain() == len(even)  # an outage on some subjects blocks no others
        heads = {e.id for e in odd if e.sequence == 1}
        # Each odd order's head failed (and, retried within the drain, may have failed again);
        # nothing queued behind a head was tried, and no failure counted as an attempt.
        waiting = {
            entry.get("_id", entry.get("id")): entry for entry in await unsettled(outbox, db)
        }
        assert set(waiting) == {e.id for e in odd}
        assert {i for i, entry in waiting.items() if entry.get("last_error")} == heads
        assert all("NoStreamResponseError" in waiting[i]["last_error"] for i in heads)
        assert all(entry.get("attempts", 0) == 0 for entry in waiting.values())
        assert set(relay.stats.errors_by_type) == {"BrokerUnavailableError"}
        assert relay.stats.failed >= len(heads)

        # Still no stream: later rounds retry the same heads after their backoff, and fail.
        for _ in range(200):
            if relay.stats.failed >= 3 * len(heads):
                break
            assert await relay.drain() == 0
            await asyncio.sleep(0.01)
        assert relay.stats.failed >= 3 * len(heads)
        assert await relay.parked() == []

        await js.add_stream(name=f"{unique}odd", subjects=[f"{unique}odd.>"])
        assert await drain_until(relay, len(odd)) == len(odd)
        assert await unsettled(outbox, db) == []
        for name, sent in ((f"{unique}even", even), (f"{unique}odd", odd)):
            messages = await read_stream(nats_client, name, len(sent))
            received = [Event.from_json(m.data) for m in messages]
            assert_in_aggregate_order(received, sent)  # the retried ones kept their ids
            assert [m.headers["Nats-Msg-Id"] for m in messages] == [e.id for e in received]
    finally:
        await publisher.aclose()
        for name in (f"{unique}even", f"{unique}odd"):
            if name in {info.config.name for info in await js.streams_info()}:
                await js.delete_stream(name)


@pytest.mark.parametrize("mode", MODES)
async def test_relay_retries_unroutable_messages_until_a_queue_is_bound(
    db: Any, channel: Any, unique: str, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    committed = await save_history(outbox, db, orders=4, saves=2)
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)  # no queue yet
    relay = PollingRelay(outbox, publisher, settings=ONE_ATTEMPT)
    try:
        assert await relay.drain() == 0
        assert relay.stats.failed == 4
        # Returned as unroutable: waiting for a queue, not the message's fault, so not parked.
        assert relay.stats.errors_by_type == {"BrokerUnavailableError": 4}
        assert "PublishError" in (relay.stats.last_error or "")
        assert "NO_ROUTE" in (relay.stats.last_error or "")
        assert await relay.parked() == []
        queue = await bind_queue(channel, unique)
        assert await drain_until(relay, len(committed)) == len(committed)
    finally:
        await publisher.aclose()
    assert await unsettled(outbox, db) == []
    messages = await drain_queue(queue, len(committed))
    assert [m.message_id for m in messages] == [Event.from_json(m.body).id for m in messages]
    assert_in_aggregate_order([Event.from_json(m.body) for m in messages], committed)
