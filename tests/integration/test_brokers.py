"""Publishers against the real RabbitMQ and NATS JetStream, and the relay end to end to each."""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika
import pytest

from mongo_outbox import Backoff, Event, InvalidEventError, Outbox, PollingRelay
from mongo_outbox.publishers import NatsPublisher, Publisher, RabbitMQPublisher
from tests.servers import NATS_URL, RABBITMQ_URL


def event(**fields: Any) -> Event:
    base: dict[str, Any] = {
        "type": "order.placed",
        "payload": {"total": 12.5, "items": [1, 2]},
        "aggregate_type": "orders",
        "aggregate_id": 7,
        "sequence": 3,
        "headers": {"tenant": "acme"},
        "correlation_id": "corr-1",
    }
    return Event(**(base | fields))


async def read_stream(nats_client: Any, stream: str, count: int) -> list[Any]:
    """Every message in ``stream``, in stream order, through an ephemeral ordered consumer."""
    js = nats_client.jetstream()
    info = await js.stream_info(stream)
    assert info.state.messages == count
    sub = await js.subscribe(f"{stream}.>", ordered_consumer=True)
    messages = [await sub.next_msg(timeout=5) for _ in range(count)]
    await sub.unsubscribe()
    return messages


@pytest.fixture
async def rabbit_queue(amqp_connection: Any, unique: str) -> Any:
    """A topic exchange ``unique`` with an exclusive queue bound to every routing key."""
    channel = await amqp_connection.channel()
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(exclusive=True)
    await queue.bind(exchange, "#")
    yield queue
    await exchange.delete()
    await channel.close()


async def drain_queue(queue: Any, count: int) -> list[Any]:
    messages = []
    async with queue.iterator(timeout=5) as iterator:
        async for message in iterator:
            await message.ack()
            messages.append(message)
            if len(messages) == count:
                break
    return messages


def test_publishers_satisfy_the_protocol() -> None:
    from mongo_outbox.publishers import MemoryPublisher

    assert isinstance(MemoryPublisher(), Publisher)
    assert {"publish", "aclose"} <= set(dir(NatsPublisher)) & set(dir(RabbitMQPublisher))


async def test_nats_message_carries_the_event_and_its_id(
    nats_client: Any, nats_stream: str
) -> None:
    publisher = await NatsPublisher.connect(
        NATS_URL, subject=f"{nats_stream}.{{aggregate_type}}.{{type}}"
    )
    sent = event()
    await publisher.publish(sent)
    await publisher.aclose()
    await publisher.aclose()  # idempotent
    [message] = await read_stream(nats_client, nats_stream, 1)
    assert message.subject == f"{nats_stream}.orders.order.placed"
    assert message.headers["Nats-Msg-Id"] == sent.id
    assert message.headers["event-type"] == "order.placed"
    assert message.headers["aggregate-id"] == "7"
    assert message.headers["sequence"] == "3"
    assert message.headers["tenant"] == "acme"
    assert Event.from_json(message.data) == sent


async def test_nats_dedups_a_republished_event(nats_client: Any, nats_stream: str) -> None:
    publisher = NatsPublisher(nats_client.jetstream(), subject=lambda e: f"{nats_stream}.{e.type}")
    sent = event()
    await publisher.publish(sent)
    await publisher.publish(sent)  # a relay retrying after a crash
    await read_stream(nats_client, nats_stream, 1)


async def test_nats_rejects_what_it_cannot_deliver(nats_client: Any, unique: str) -> None:
    js = nats_client.jetstream()
    no_stream = NatsPublisher(js, subject=f"{unique}.nowhere", timeout=1)
    with pytest.raises(Exception):  # noqa: B017, PT011 - nats-py raises NoRespondersError here
        await no_stream.publish(event())
    for bad in (f"{unique}.has space", f"{unique}..empty", f"{unique}.*", ""):
        with pytest.raises(InvalidEventError):
            await NatsPublisher(js, subject=bad).publish(event())
    with pytest.raises(InvalidEventError):
        await NatsPublisher(js, subject="{missing_field}").publish(event())


async def test_rabbitmq_message_is_persistent_and_carries_the_id(
    rabbit_queue: Any, unique: str
) -> None:
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    sent = event()
    await publisher.publish(sent)
    await publisher.aclose()
    await publisher.aclose()
    [message] = await drain_queue(rabbit_queue, 1)
    assert message.message_id == sent.id
    assert message.routing_key == "order.placed"
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.content_type == "application/json"
    assert message.correlation_id == "corr-1"
    assert message.headers["aggregate-type"] == "orders"
    assert Event.from_json(message.body) == sent


async def test_rabbitmq_unroutable_message_is_an_error(amqp_connection: Any, unique: str) -> None:
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)  # no queue bound
    with pytest.raises(aio_pika.exceptions.DeliveryError):
        await publisher.publish(event())
    channel = await amqp_connection.channel()
    await channel.exchange_delete(unique)
    await publisher.aclose()
    with pytest.raises(Exception):  # noqa: B017, PT011 - a closed channel, whatever aio-pika calls it
        await publisher.publish(event())


async def test_many_messages_in_flight_keep_per_aggregate_order(
    rabbit_queue: Any, unique: str
) -> None:
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    events = [event(aggregate_id=a, sequence=s) for s in range(1, 6) for a in range(100)]
    # The relay's pattern: all aggregates at once, one event per aggregate at a time.
    for s in range(1, 6):
        await asyncio.gather(*(publisher.publish(e) for e in events if e.sequence == s))
    await publisher.aclose()
    received = [Event.from_json(m.body) for m in await drain_queue(rabbit_queue, len(events))]
    assert sorted(e.id for e in received) == sorted(e.id for e in events)
    for aggregate in range(100):
        assert [e.sequence for e in received if e.aggregate_id == aggregate] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("broker", ["nats", "rabbitmq"])
@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_relay_end_to_end(
    client: Any,
    db: Any,
    nats_client: Any,
    nats_stream: str,
    rabbit_queue: Any,
    unique: str,
    mode: str,
    broker: str,
) -> None:
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    committed: list[Event] = []
    for order in range(20):
        for step in range(2):
            saved = await outbox.save_with_events(
                None,
                db.orders,
                {"_id": order, "step": step},
                [Event(type="order.changed", payload={"step": step}), Event(type="order.noted")],
            )
            committed += saved.events
    async with client.start_session() as session:  # an aborted save publishes nothing
        with pytest.raises(RuntimeError):
            async with await session.start_transaction():
                await outbox.save_with_events(session, db.orders, {"_id": 99}, [Event(type="x")])
                raise RuntimeError("abort on purpose")
    publisher: Publisher
    if broker == "nats":
        publisher = await NatsPublisher.connect(
            NATS_URL, subject=f"{nats_stream}.{{aggregate_type}}.{{type}}"
        )
    else:
        publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    relay = PollingRelay(outbox, publisher, batch_size=16)
    assert await relay.drain() == len(committed)
    assert await relay.drain() == 0
    await publisher.aclose()
    if broker == "nats":
        messages = await read_stream(nats_client, nats_stream, len(committed))
        received = [Event.from_json(m.data) for m in messages]
    else:
        received = [Event.from_json(m.body) for m in await drain_queue(rabbit_queue, 80)]
        assert await rabbit_queue.get(fail=False, timeout=1) is None  # and nothing more
    assert sorted(e.id for e in received) == sorted(e.id for e in committed)
    for order in range(20):
        assert [e.sequence for e in received if e.aggregate_id == order] == [1, 2, 3, 4]


async def test_relay_backs_off_while_the_broker_refuses_then_delivers_in_order(
    db: Any, nats_client: Any, unique: str
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    saved = []
    for order in range(5):
        for _ in range(3):
            saved += (
                await outbox.save_with_events(None, db.orders, {"_id": order}, [Event(type="t")])
            ).events
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{unique}.{{type}}", timeout=0.5)
    relay = PollingRelay(
        outbox, publisher, publish_timeout=1, backoff=Backoff(initial=0.01, maximum=0.05)
    )
    assert await relay.drain() == 0  # no stream bound to the subject yet: every head fails
    assert relay.stats.failed == 5  # one head per aggregate; nothing queued behind was tried
    failed = await db.outbox.find({"attempts": 1}).to_list(None)
    assert len(failed) == 5 and all(f["last_error"] for f in failed)
    js = nats_client.jetstream()
    await js.add_stream(name=unique, subjects=[f"{unique}.>"])
    try:
        published = 0
        for _ in range(100):
            published += await relay.drain()
            if published == len(saved):
                break
            await asyncio.sleep(0.02)
        assert published == len(saved)
        received = [Event.from_json(m.data) for m in await read_stream(nats_client, unique, 15)]
        for order in range(5):
            assert [e.sequence for e in received if e.aggregate_id == order] == [1, 2, 3]
    finally:
        await publisher.aclose()
        await js.delete_stream(unique)


async def test_connect_fails_loudly_when_the_broker_is_not_there() -> None:
    with pytest.raises(ConnectionError):
        await NatsPublisher.connect("nats://127.0.0.1:1", timeout=0.5)
    with pytest.raises(ConnectionError):  # aio-pika's AMQPConnectionError is a ConnectionError
        await RabbitMQPublisher.connect("amqp://guest:guest@127.0.0.1:1/", timeout=0.5)


async def test_nats_publish_many_reports_each_event(nats_client: Any, nats_stream: str) -> None:
    publisher = NatsPublisher(nats_client.jetstream(), subject=lambda e: e.headers["to"])
    good, bad, lost = (
        event(headers={"to": f"{nats_stream}.ok"}),
        event(headers={"to": f"{nats_stream}.not valid"}),
        event(headers={"to": "nobody.listens.here"}),
    )
    results = await publisher.publish_many([good, bad, lost])
    assert results[0] is None
    assert isinstance(results[1], InvalidEventError)
    assert results[2] is not None  # no stream: JetStream answers "no responders"
    [message] = await read_stream(nats_client, nats_stream, 1)
    assert message.headers["Nats-Msg-Id"] == good.id
