"""A naming function (``subject=``, ``stream=``, ``routing_key=``, FastStream's ``destination=``)
that raises for one event fails that event alone: the relay publishes the others of its round
to the real broker, none of them charged an attempt, and retries the one it could not name (a
lookup may fail for a moment) until ``max_attempts`` parks it. A raise used to fail the whole
wave, charging every event an attempt."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from faststream.nats import NatsBroker
from faststream.rabbit import RabbitBroker
from faststream.redis import RedisBroker
from redis.asyncio import Redis

from mongo_outbox import Backoff, Event, Outbox, PollingRelay, RelaySettings
from mongo_outbox.publishers import (
    FastStreamPublisher,
    NatsPublisher,
    RabbitMQPublisher,
    RedisStreamsPublisher,
)
from tests.support.servers import NATS_URL, RABBITMQ_URL, REDIS_URL
from tests.support.waiting import until


def naming(name: str) -> Any:
    """``name`` for every event but one with a ``region`` to look up, for which it raises."""

    def destination(event: Event) -> str:
        if "region" in event.headers:
            raise LookupError(f"no route for region {event.headers['region']}")
        return name

    return destination


@contextlib.asynccontextmanager
async def publisher_for(
    kind: str, nats_stream: str, channel: Any, unique: str
) -> AsyncIterator[Any]:
    if kind == "nats":
        publisher = await NatsPublisher.connect(NATS_URL, subject=naming(f"{nats_stream}.ok"))
        yield publisher
        await publisher.aclose()
    elif kind == "rabbitmq":
        # (RabbitMQ's publisher is being rewritten: this checks what it must keep doing.)
        publisher = await RabbitMQPublisher.connect(
            RABBITMQ_URL, exchange=unique, routing_key=naming("ok")
        )
        queue = await channel.declare_queue(unique, auto_delete=True)
        await queue.bind(unique, "#")
        yield publisher
        await publisher.aclose()
        await channel.exchange_delete(unique)
    elif kind == "redis":
        client = Redis.from_url(REDIS_URL)
        yield RedisStreamsPublisher(client, stream=naming(unique))
        await client.delete(unique)
        await client.aclose()
    elif kind == "faststream-nats":
        async with NatsBroker(NATS_URL) as broker:
            yield FastStreamPublisher(broker, naming(f"{nats_stream}.ok"), stream=nats_stream)
    elif kind == "faststream-redis":
        async with RedisBroker(REDIS_URL) as broker:
            yield FastStreamPublisher(broker, naming(unique))
        client = Redis.from_url(REDIS_URL)
        await client.delete(unique)
        await client.aclose()
    else:
        await channel.declare_queue(unique, auto_delete=True)
        async with RabbitBroker(RABBITMQ_URL) as broker:
            yield FastStreamPublisher(broker, naming(unique))  # the default exchange


@pytest.mark.parametrize(
    "kind",
    ["nats", "rabbitmq", "redis", "faststream-nats", "faststream-redis", "faststream-rabbitmq"],
)
async def test_a_naming_function_that_raises_for_one_event_fails_that_event_alone(
    db: Any, nats_stream: str, channel: Any, unique: str, kind: str
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    saved: list[Event] = []
    for n in range(3):
        headers = {"region": "mars"} if n == 1 else {}
        events = [Event(type="order.placed", headers=headers)]
        saved += (await outbox.save_with_events(None, db.orders, {"_id": n}, events)).events
    good, bad = [saved[0], saved[2]], saved[1]
    settings = RelaySettings(max_attempts=2, backoff=Backoff(initial=0.01, maximum=0.02))
    async with publisher_for(kind, nats_stream, channel, unique) as publisher:
        relay = PollingRelay(outbox, publisher, settings=settings)
        assert await relay.drain() == 2  # one round: the others of its wave went out
        entries = {e["_id"]: e async for e in db.outbox.find()}
        assert [(entries[e.id]["status"], entries[e.id]["attempts"]) for e in good] == [
            ("published", 0),
            ("published", 0),
        ]
        assert (entries[bad.id]["status"], entries[bad.id]["attempts"]) == ("pending", 1)
        assert "no route for region mars" in entries[bad.id]["last_error"]
        # Retried as a failed publish (a lookup may fail for a moment), then parked: by the
        # round that claims it once its backoff has passed.

        async def parked_once_retried() -> bool:
            assert await relay.drain() == 0
            return bool(await relay.parked())

        await until(parked_once_retried)
        [parked] = await relay.parked()
        assert (parked["_id"], parked["attempts"]) == (bad.id, 2)
        assert "naming function 'destination' failed" in parked["last_error"]
