"""FastStreamPublisher: the relay publishes through FastStream brokers. RabbitMQ, NATS JetStream
and Redis streams are the real servers; Kafka runs through FastStream's TestKafkaBroker, an
in-memory fake (no Kafka server here), which checks what is sent, not what Kafka does with it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import pytest
from faststream import Context
from faststream.kafka import KafkaBroker, TestKafkaBroker
from faststream.nats import JStream, NatsBroker
from faststream.rabbit import RabbitBroker
from faststream.redis import RedisBroker, StreamSub

from mongo_outbox import (
    BrokerUnavailableError,
    ConfigurationError,
    Event,
    InvalidEventError,
    Outbox,
    PollingRelay,
    RelaySettings,
)
from mongo_outbox.errors import unavailable
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import FastStreamPublisher
from tests.support.brokers import HAVE_NATS_SERVER, Broker
from tests.support.messages import bind_queue, drain_queue, read_stream
from tests.support.redis_server import HAVE_REDIS_SERVER, RedisServer
from tests.support.servers import NATS_URL, RABBITMQ_URL, REDIS_URL
from tests.support.waiting import until


async def save(db: Any, count: int) -> list[Event]:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    saved: list[Event] = []
    for n in range(count):
        result = await outbox.save_with_events(
            None,
            db.orders,
            {"_id": f"o{n}", "total": n},
            [Event(type="order.placed", payload={"n": n}, headers={"tenant": "acme"})],
        )
        saved += result.events
    return saved


async def relay(db: Any, publisher: FastStreamPublisher) -> int:
    return await PollingRelay(Outbox(db), publisher).drain()


async def test_rabbitmq_messages_carry_the_event_id_and_headers(
    db: Any, channel: Any, unique: str
) -> None:
    saved = await save(db, 3)
    queue = await bind_queue(channel, unique)
    async with RabbitBroker(RABBITMQ_URL) as broker:
        assert await relay(db, FastStreamPublisher(broker, "{type}", exchange=unique)) == 3
    messages = await drain_queue(queue, 3)
    # Events of different aggregates are published concurrently: in any order.
    by_id = {m.message_id: m for m in messages}
    assert set(by_id) == {e.id for e in saved}
    for event in saved:
        message = by_id[event.id]
        assert Event.from_json(message.body) == event
        assert message.headers["aggregate-id"] == event.aggregate_id
        assert message.headers["tenant"] == "acme"
        assert message.routing_key == "order.placed"


async def test_rabbitmq_an_event_from_before_1970_goes_out_without_an_amqp_timestamp(
    channel: Any, unique: str
) -> None:
    # AMQP's timestamp is unsigned: pamqp raised struct.error for it, so the event failed
    # every attempt and was parked (a backfilled history of old events, all of them).
    queue = await bind_queue(channel, unique)
    landing = datetime(1969, 7, 20, 20, 17, 40, tzinfo=timezone.utc)
    old, new = Event(type="moon.landed", occurred_at=landing), Event(type="moon.landed")
    async with RabbitBroker(RABBITMQ_URL) as broker:
        publisher = FastStreamPublisher(broker, "{type}", exchange=unique)
        await publisher.publish(old)
        await publisher.publish(new)
    by_id = {m.message_id: m for m in await drain_queue(queue, 2)}
    # FastStream stamps a message given no timestamp with the time it sends it; the body
    # says when the event occurred.
    assert by_id[old.id].timestamp is not None and by_id[old.id].timestamp.year > 2000
    assert Event.from_json(by_id[old.id].body).occurred_at == landing
    assert by_id[new.id].timestamp == new.occurred_at.replace(microsecond=0)


async def test_rabbitmq_unroutable_message_is_an_outage_of_its_destination(
    channel: Any, unique: str
) -> None:
    await channel.declare_exchange(unique, "topic", durable=True)  # bound to no queue
    async with RabbitBroker(RABBITMQ_URL) as broker:
        publisher = FastStreamPublisher(broker, "{type}", exchange=unique)
        event = Event(type="order.placed")
        with pytest.raises(BrokerUnavailableError) as raised:
            await publisher.publish(event)
    assert raised.value.destination == "order.placed" and raised.value.event_id == event.id


async def test_nats_messages_are_deduplicated_by_jetstream_on_the_event_id(
    db: Any, nats_client: Any, nats_stream: str
) -> None:
    saved = await save(db, 3)
    async with NatsBroker(NATS_URL) as broker:
        publisher = FastStreamPublisher(broker, f"{nats_stream}.{{type}}", stream=nats_stream)
        assert await relay(db, publisher) == 3
        await publisher.publish(saved[0])  # a relay's republish after a crash
    messages = await read_stream(nats_client, nats_stream, 3)
    by_id = {m.headers["Nats-Msg-Id"]: m for m in messages}
    assert set(by_id) == {e.id for e in saved}
    for event in saved:
        assert Event.from_json(by_id[event.id].data) == event
        assert by_id[event.id].headers["aggregate-id"] == event.aggregate_id


async def test_a_faststream_subscriber_sees_the_event_id_as_message_id_on_nats_and_redis(
    db: Any, nats_stream: str, unique: str
) -> None:
    saved = await save(db, 2)
    seen: dict[str, list[tuple[str, str]]] = {"nats": [], "redis": []}
    nats_broker = NatsBroker(NATS_URL)
    redis_broker = RedisBroker(REDIS_URL)

    @nats_broker.subscriber(
        f"{nats_stream}.>", stream=JStream(nats_stream, declare=False), queue=unique
    )
    async def on_nats(message: Annotated[Any, Context("message")]) -> None:
        seen["nats"].append((message.message_id, Event.from_json(message.body).id))

    @redis_broker.subscriber(stream=StreamSub(unique, last_id="0"))
    async def on_redis(message: Annotated[Any, Context("message")]) -> None:
        seen["redis"].append((message.message_id, Event.from_json(message.body).id))

    try:
        async with nats_broker, redis_broker:
            await nats_broker.start()
            await redis_broker.start()
            nats_publisher = FastStreamPublisher(
                nats_broker, f"{nats_stream}.x", stream=nats_stream
            )
            assert await relay(db, nats_publisher) == 2
            redis_publisher = FastStreamPublisher(redis_broker, unique)
            for event in saved:
                await redis_publisher.publish(event)

            def both_seen() -> bool:
                return all(len(v) >= 2 for v in seen.values())

            await until(both_seen, 30)
    finally:
        await _delete_redis_key(unique)
    expected = sorted((e.id, e.id) for e in saved)
    assert {k: sorted(v) for k, v in seen.items()} == {"nats": expected, "redis": expected}


async def _delete_redis_key(key: str) -> None:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(REDIS_URL)
    try:
        await client.delete(key)
    finally:
        await client.aclose()


async def test_redis_stream_entries_carry_the_event_and_its_id(db: Any, unique: str) -> None:
    saved = await save(db, 3)
    try:
        async with RedisBroker(REDIS_URL) as broker:
            assert await relay(db, FastStreamPublisher(broker, unique)) == 3
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            entries = await client.xrange(unique)
        finally:
            await client.aclose()
        assert len(entries) == 3
        decoded = []
        for _, fields in entries:
            # FastStream's envelope: the body and its headers in one field.
            body, headers = broker.message_format.parse(fields[b"__data__"])
            decoded.append((Event.from_json(body), headers))
        assert sorted(e.id for e, _ in decoded) == sorted(e.id for e in saved)
        for event, headers in decoded:
            assert event in saved and headers["message_id"] == event.id
            assert headers["aggregate-id"] == event.aggregate_id
    finally:
        await _delete_redis_key(unique)


async def test_redis_down_is_an_outage() -> None:
    port = _closed_port()
    async with RedisBroker(f"redis://127.0.0.1:{port}") as broker:
        publisher = FastStreamPublisher(broker, "events", timeout=2)
        event = Event(type="order.placed")
        with pytest.raises(BrokerUnavailableError) as raised:
            await publisher.publish(event)
    assert unavailable(raised.value) and raised.value.event_id == event.id


@pytest.fixture
async def private_redis(tmp_path: Path) -> AsyncIterator[RedisServer]:
    if not HAVE_REDIS_SERVER:
        pytest.skip("needs the redis-server binary to run a server of the test's own")
    server = RedisServer(tmp_path)
    await server.start()
    yield server
    if server.process and server.process.returncode is None:
        await server.kill()


# How a real Redis refuses writes during a failover, and how it takes them again.
FAILOVERS = {
    # A former master demoted to a replica: READONLY (redis-py's ReadOnlyError).
    "demoted": (("REPLICAOF", "127.0.0.1", "1"), ("REPLICAOF", "NO", "ONE")),
    # A master that lost the replicas it needs to acknowledge a write: NOREPLICAS.
    "replicas lost": (
        ("CONFIG", "SET", "min-replicas-to-write", "1"),
        ("CONFIG", "SET", "min-replicas-to-write", "0"),
    ),
}


@pytest.mark.parametrize("failover", FAILOVERS)
async def test_a_redis_failover_is_an_outage_as_for_the_redis_publisher(
    db: Any, private_redis: RedisServer, failover: str
) -> None:
    """FastStream's Redis path classifies errors as RedisStreamsPublisher does: a failover waits
    (it used to count attempts, and park every event after ``max_attempts``)."""
    import redis.asyncio

    saved = await save(db, 2)
    start, end = FAILOVERS[failover]
    admin = redis.asyncio.Redis.from_url(private_redis.url)
    try:
        async with RedisBroker(private_redis.url) as broker:
            await broker.connect()
            publisher = FastStreamPublisher(broker, "events", timeout=2)
            await admin.execute_command(*start)
            with pytest.raises(BrokerUnavailableError) as raised:
                await publisher.publish(saved[0])
            assert unavailable(raised.value)
            relay = PollingRelay(Outbox(db), publisher, settings=RelaySettings(max_attempts=1))
            assert await relay.drain() == 0
            assert await relay.parked() == []  # with one attempt allowed, a counted one parks
            stored = await db.outbox.find({}).to_list(None)
            assert [(e["status"], e.get("attempts", 0)) for e in stored] == [("pending", 0)] * 2
            await admin.execute_command(*end)
            await db.outbox.update_many({}, {"$set": {"available_at": utc_now()}})
            assert await relay.drain() == 2
        assert await admin.xlen("events") == 2
    finally:
        await admin.aclose()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the block ends


async def test_a_broker_not_connected_is_an_outage_the_relay_does_not_count(db: Any) -> None:
    saved = await save(db, 1)
    publisher = FastStreamPublisher(RabbitBroker(RABBITMQ_URL), "{type}")
    with pytest.raises(BrokerUnavailableError):
        await publisher.publish(saved[0])
    assert await relay(db, publisher) == 0
    stored = await db.outbox.find_one({"_id": saved[0].id})
    assert stored["status"] == "pending" and stored.get("attempts", 0) == 0


@pytest.fixture
async def private_nats(tmp_path: Path) -> AsyncIterator[Broker]:
    if not HAVE_NATS_SERVER:
        pytest.skip("needs the nats-server binary to run a broker of the test's own")
    server = Broker(tmp_path)
    await server.start()
    yield server
    if server.process and server.process.returncode is None:
        await server.kill()


async def test_nats_server_killed_is_an_outage_and_publishing_resumes(
    private_nats: Broker,
) -> None:
    import nats

    nc = await nats.connect(private_nats.url)
    await nc.jetstream().add_stream(name="orders", subjects=["orders.>"])
    await nc.close()
    async with NatsBroker(private_nats.url, max_reconnect_attempts=-1) as broker:
        publisher = FastStreamPublisher(broker, "orders.{type}", stream="orders", timeout=1)
        await publisher.publish(Event(type="placed"))
        await private_nats.kill()
        lost = Event(type="placed")
        with pytest.raises(BrokerUnavailableError) as raised:
            await publisher.publish(lost)
        assert raised.value.event_id == lost.id
        await private_nats.start()

        async def published() -> bool:
            with contextlib.suppress(BrokerUnavailableError):
                await publisher.publish(lost)
                return True
            return False

        await until(published, 30)


async def test_kafka_key_is_the_aggregate_id_through_the_in_memory_test_broker(db: Any) -> None:
    """FastStream's TestKafkaBroker is a fake: no Kafka server runs here."""
    saved = await save(db, 3)
    broker = KafkaBroker("127.0.0.1:9092")
    received: list[tuple[bytes | None, dict[str, Any], Event]] = []

    @broker.subscriber("orders")
    async def on_order(message: Annotated[Any, Context("message")]) -> None:
        received.append(
            (message.raw_message.key, dict(message.headers), Event.from_json(message.body))
        )

    async with TestKafkaBroker(broker, connect_only=False) as fake:
        assert await relay(db, FastStreamPublisher(fake, "orders")) == 3
    assert sorted(event.id for _, _, event in received) == sorted(e.id for e in saved)
    for key, headers, event in received:
        assert event in saved and key == str(event.aggregate_id).encode()
        assert headers["message_id"] == event.id and headers["aggregate-id"] == key.decode()
        assert headers["correlation_id"] == event.id and headers["tenant"] == "acme"


def test_settings_are_checked_before_anything_is_published() -> None:
    with pytest.raises(ConfigurationError, match="required for NATS"):
        FastStreamPublisher(NatsBroker(NATS_URL), "orders")
    with pytest.raises(ConfigurationError, match="only for NATS"):
        FastStreamPublisher(RabbitBroker(RABBITMQ_URL), "orders", stream="orders")
    with pytest.raises(ConfigurationError, match="exchange is for RabbitMQ"):
        FastStreamPublisher(RedisBroker(REDIS_URL), "orders", exchange="x")
    with pytest.raises(ConfigurationError, match="not object"):
        FastStreamPublisher(object(), "orders")


async def test_an_event_no_broker_can_carry_is_refused_before_it_is_sent() -> None:
    # Not even connected: the refusal comes first, as the event's own fault (parked).
    nats_publisher = FastStreamPublisher(NatsBroker(NATS_URL), "orders.{type}", stream="s")
    with pytest.raises(InvalidEventError, match="not a valid NATS subject"):
        await nats_publisher.publish(Event(type="a.>"))
    redis_publisher = FastStreamPublisher(RedisBroker(REDIS_URL), "{aggregate_type}")
    with pytest.raises(InvalidEventError, match="aggregate_type"):
        await redis_publisher.publish(Event(type="placed"))  # no aggregate_type to render
