"""A relay process SIGKILLed between publishing and marking published loses nothing: after the
lease another relay publishes its claims again, under the same ids, in order per aggregate."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from mongo_outbox import Event, Outbox, PollingRelay
from mongo_outbox.publishers import NatsPublisher, RabbitMQPublisher
from tests.support.outboxes import assert_in_order, unsettled
from tests.support.servers import NATS_URL, RABBITMQ_URL, MongoServer

ROOT = Path(__file__).resolve().parents[3]


async def run_crashing_relay(
    mongo: MongoServer, db: Any, mode: str, broker: str, target: str
) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.crash.relay_process",
        mongo.uri,
        db.name,
        mode,
        broker,
        target,
        "7",
        cwd=ROOT,
    )
    assert await asyncio.wait_for(process.wait(), 60) == -signal.SIGKILL


async def marked_before_the_kill(outbox: Outbox, db: Any, saved: list[Event]) -> int:
    """How many events the killed relay marked published: it died at its 7th confirm, before
    marking that one, so fewer than 7. Usually none: one round claims all 24; on a loaded
    machine a round can run short of its 2 s claim, mark what it had confirmed, and claim the
    rest again before the kill."""
    left = await unsettled(outbox, db)
    assert {e["_id"] if "_id" in e else e["id"] for e in left} <= {e.id for e in saved}
    marked = len(saved) - len(left)
    assert 0 <= marked < 7
    return marked


async def save_orders(outbox: Outbox, db: Any) -> list[Event]:
    saved: list[Event] = []
    for step in range(3):
        for order in range(8):
            result = await outbox.save_with_events(
                None, db.orders, {"_id": order, "step": step}, [Event(type="order.step")]
            )
            saved += result.events
    return saved


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_killed_relay_loses_nothing_rabbitmq(
    mongo: MongoServer, db: Any, amqp_connection: Any, unique: str, mode: str
) -> None:
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    saved = await save_orders(outbox, db)
    channel = await amqp_connection.channel()
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(exclusive=True)
    await queue.bind(exchange, "#")

    await run_crashing_relay(mongo, db, mode, "rabbitmq", unique)
    marked = await marked_before_the_kill(outbox, db, saved)
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    relay = PollingRelay(outbox, publisher)
    assert await relay.drain() == 0  # the dead relay's lease still holds
    await asyncio.sleep(2.1)
    assert await relay.drain() == len(saved) - marked
    await publisher.aclose()

    received = []
    while (message := await queue.get(fail=False, timeout=2)) is not None:
        await message.ack()
        received.append((message.message_id, Event.from_json(message.body)))
    await exchange.delete()
    await channel.close()
    ids = [event.id for _, event in received]
    assert all(message_id == event.id for message_id, event in received)
    assert set(ids) == {e.id for e in saved}
    # Those confirmed before the kill and not marked arrive twice, under the same ids.
    assert len(ids) == len(saved) + 7 - marked
    assert_in_order([e for _, e in received], saved, once=False)


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_killed_relay_loses_nothing_nats(
    mongo: MongoServer, db: Any, nats_client: Any, nats_stream: str, mode: str
) -> None:
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    saved = await save_orders(outbox, db)
    await run_crashing_relay(mongo, db, mode, "nats", nats_stream)
    marked = await marked_before_the_kill(outbox, db, saved)
    js = nats_client.jetstream()
    assert (await js.stream_info(nats_stream)).state.messages == 7
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    await asyncio.sleep(2.1)
    assert await PollingRelay(outbox, publisher).drain() == len(saved) - marked
    await publisher.aclose()
    # JetStream dropped the 7 republished messages as duplicates of their Nats-Msg-Id.
    assert (await js.stream_info(nats_stream)).state.messages == len(saved)
    sub = await js.subscribe(f"{nats_stream}.>", ordered_consumer=True)
    messages = [await sub.next_msg(timeout=5) for _ in saved]
    await sub.unsubscribe()
    assert all(m.headers["Nats-Msg-Id"] == Event.from_json(m.data).id for m in messages)
    assert {Event.from_json(m.data).id for m in messages} == {e.id for e in saved}
    assert_in_order([Event.from_json(m.data) for m in messages], saved, once=False)
