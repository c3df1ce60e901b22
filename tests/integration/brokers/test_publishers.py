"""Each publisher against its real broker: what a message carries, what the broker refuses,
and many messages in flight at once. The relay end to end is in test_relay_brokers.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import aiormq
import nats.js.errors
import pytest

from mongo_outbox import (
    BrokerUnavailableError,
    ConfigurationError,
    Event,
    InvalidEventError,
    PublishError,
)
from mongo_outbox.brokers._publishing import NamingFailed
from mongo_outbox.errors import unavailable
from mongo_outbox.publishers import (
    BatchPublisher,
    MemoryPublisher,
    NatsPublisher,
    Publisher,
    RabbitMQPublisher,
)
from tests.support.messages import bind_queue, drain_queue, event, read_stream
from tests.support.outboxes import assert_in_order
from tests.support.servers import NATS_URL, RABBITMQ_URL


def waves(aggregates: int, per_aggregate: int) -> list[list[Event]]:
    """The relay's pattern: wave k holds the k-th event of every aggregate."""
    return [
        [event(aggregate_id=a, sequence=s) for a in range(aggregates)]
        for s in range(1, per_aggregate + 1)
    ]


class Writes:
    """A counting proxy over a real AMQP connection: how many entries its write queue took
    (aiormq writes each entry as one buffer)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def write_queue(self) -> Any:
        return self

    def full(self) -> bool:
        return bool(self.inner.write_queue.full())

    def put_nowait(self, item: Any) -> None:
        self.count += 1
        self.inner.write_queue.put_nowait(item)

    async def put(self, item: Any) -> None:
        self.count += 1
        await self.inner.write_queue.put(item)


class Proxy:
    """Forwards everything to ``inner`` but the attributes given."""

    def __init__(self, inner: Any, **attributes: Any) -> None:
        self.inner = inner
        self.__dict__.update(attributes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Unacked:
    """How many messages a real NATS connection had written to its socket whose reply had not
    come back yet, at most. Replies are what the connection received (its ``in_msgs``): the
    test's connection subscribes to nothing else while it publishes."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.sent = self.peak = 0
        self._received_before = nc.stats["in_msgs"]
        transport = nc._transport
        write = transport.writelines

        def writelines(commands: list[bytes]) -> None:
            for command in commands:
                self.sent += command.count(b"HPUB ")
            replied = nc.stats["in_msgs"] - self._received_before
            self.peak = max(self.peak, self.sent - replied)
            write(commands)

        transport.writelines = writelines


# --- the contract ------------------------------------------------------------------------


async def test_every_publisher_satisfies_the_protocol(nats_client: Any, channel: Any) -> None:
    exchange = await channel.get_exchange("amq.topic")
    publishers = [
        MemoryPublisher(),
        NatsPublisher(nats_client.jetstream()),
        RabbitMQPublisher(exchange),
    ]
    assert all(isinstance(p, Publisher) for p in publishers)
    # NATS and RabbitMQ pipeline a whole wave themselves; memory gets one relay task per event.
    assert [isinstance(p, BatchPublisher) for p in publishers] == [False, True, True]


async def test_memory_publisher_records_rehearses_failures_and_closes() -> None:
    broken = event(type="broken")
    publisher = MemoryPublisher(fail=lambda e: RuntimeError("no") if e.type == "broken" else None)
    first, second = event(sequence=1), event(sequence=2)
    await asyncio.gather(publisher.publish(first), publisher.publish(second))
    with pytest.raises(RuntimeError, match="no"):
        await publisher.publish(broken)
    assert await publisher.wait_for(2, timeout=1) == [first, second]
    with pytest.raises(asyncio.TimeoutError):
        await publisher.wait_for(3, timeout=0.05)
    await publisher.aclose()
    await publisher.aclose()
    with pytest.raises(PublishError) as closed:
        await publisher.publish(event())
    assert publisher.events == [first, second]
    assert closed.value.event_id is not None


def test_names_render_from_the_event_and_refuse_what_they_cannot_render() -> None:
    js: Any = None  # subject_for and routing_key_for never touch the broker
    assert NatsPublisher(js).subject_for(event()) == "events.orders.order.placed"
    assert RabbitMQPublisher(js).routing_key_for(event()) == "order.placed"
    custom = NatsPublisher(js, subject=lambda e: f"x.{e.headers['tenant']}.{e.aggregate_id}")
    assert custom.subject_for(event()) == "x.acme.7"
    templated = RabbitMQPublisher(js, routing_key="{aggregate_type}.{headers[tenant]}")
    assert templated.routing_key_for(event()) == "orders.acme"
    unsaved = Event(type="t")  # never went through save_with_events: no aggregate_type
    for template in ("events.{aggregate_type}.{type}", "{type.nope}", "{headers[x]}"):
        with pytest.raises(InvalidEventError) as error:
            NatsPublisher(js, subject=template).subject_for(unsaved)
        assert error.value.event_id == unsaved.id
    with pytest.raises(InvalidEventError):
        RabbitMQPublisher(js).routing_key_for(event(type="é" * 128))  # 256 bytes in UTF-8
    assert RabbitMQPublisher(js).routing_key_for(event(type="e" * 200)) == "e" * 200


# --- NATS JetStream ----------------------------------------------------------------------


async def test_nats_message_carries_the_event_its_id_and_headers(
    nats_client: Any, nats_stream: str
) -> None:
    publisher = await NatsPublisher.connect(
        NATS_URL, subject=f"{nats_stream}.{{aggregate_type}}.{{type}}"
    )
    sent = event()
    await publisher.publish(sent)
    [message] = await read_stream(nats_client, nats_stream, 1)
    assert message.subject == f"{nats_stream}.orders.order.placed"
    assert Event.from_json(message.data) == sent
    assert message.headers == {
        "Nats-Msg-Id": sent.id,
        "Content-Type": "application/json",
        "event-type": "order.placed",
        "aggregate-type": "orders",
        "aggregate-id": "7",
        "sequence": "3",
        "tenant": "acme",
        "trace": "t-1",
    }
    await publisher.aclose()


async def test_nats_deduplicates_a_republished_event(nats_client: Any, nats_stream: str) -> None:
    js = nats_client.jetstream()
    publisher = NatsPublisher(js, subject=lambda e: f"{nats_stream}.{e.type}")
    sent, other = event(), event()
    await publisher.publish(sent)
    await publisher.publish(sent)  # a relay retrying after a lost ack
    await publisher.publish_many([sent, other, sent])
    messages = await read_stream(nats_client, nats_stream, 2)
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [sent.id, other.id]
    # The stream keys on the header: the same id once more is acked as a duplicate of seq 1.
    ack = await js.publish(f"{nats_stream}.x", b"{}", headers={"Nats-Msg-Id": sent.id})
    assert (ack.duplicate, ack.seq, ack.stream) == (True, 1, nats_stream)


async def test_nats_raises_when_no_stream_takes_the_subject(nats_client: Any, unique: str) -> None:
    publisher = NatsPublisher(nats_client.jetstream(), subject=f"{unique}.nowhere", timeout=5)
    # No stream (yet, or JetStream restarting): the relay waits for one, parking nothing.
    with pytest.raises(BrokerUnavailableError) as raised:
        await publisher.publish(event())
    assert isinstance(raised.value.__cause__, nats.js.errors.NoStreamResponseError)
    assert unavailable(raised.value)


async def test_nats_raises_the_streams_own_refusal(nats_client: Any, unique: str) -> None:
    js = nats_client.jetstream()
    await js.add_stream(name=unique, subjects=[f"{unique}.>"], max_msg_size=64)
    try:
        # A long timeout: the refusal must come back as the stream's error, not as a timeout.
        publisher = NatsPublisher(js, subject=f"{unique}.{{type}}", timeout=60)
        with pytest.raises(nats.js.errors.BadRequestError, match="size exceeds"):
            await publisher.publish(event())
        [result] = await publisher.publish_many([event()])
        assert isinstance(result, nats.js.errors.BadRequestError)
        assert not unavailable(result)  # the message's own fault: an attempt that counts
        assert (await js.stream_info(unique)).state.messages == 0
    finally:
        await js.delete_stream(unique)


@pytest.mark.parametrize(
    "subject", ["{u}.has space", "{u}..empty", "{u}.*", "{u}.>", "{u}.a*b", "{u}.", ".{u}"]
)
async def test_nats_refuses_an_invalid_subject(
    nats_client: Any, nats_stream: str, subject: str
) -> None:
    publisher = NatsPublisher(nats_client.jetstream(), subject=subject.format(u=nats_stream))
    sent = event()
    with pytest.raises(InvalidEventError) as error:
        await publisher.publish(sent)
    assert error.value.event_id == sent.id
    assert (await nats_client.jetstream().stream_info(nats_stream)).state.messages == 0


async def test_nats_publish_many_reports_each_event_in_order(
    nats_client: Any, nats_stream: str
) -> None:
    publisher = NatsPublisher(nats_client.jetstream(), subject=lambda e: e.headers["to"])
    good, bad, lost, also_good = (
        event(headers={"to": f"{nats_stream}.ok"}),
        event(headers={"to": f"{nats_stream}.not valid"}),
        event(headers={"to": f"{nats_stream}x.nobody"}),
        event(headers={"to": f"{nats_stream}.ok"}),
    )
    results = await publisher.publish_many([good, bad, lost, also_good])
    assert results[0] is None and results[3] is None
    assert isinstance(results[1], InvalidEventError)
    assert isinstance(results[2], BrokerUnavailableError)
    assert isinstance(results[2].__cause__, nats.js.errors.NoStreamResponseError)
    messages = await read_stream(nats_client, nats_stream, 2)
    assert {m.headers["Nats-Msg-Id"] for m in messages} == {good.id, also_good.id}


@pytest.mark.parametrize("returns", ["raises", "none", "int", "empty"])
async def test_a_naming_function_that_fails_for_one_event_fails_that_event_only(
    nats_client: Any, nats_stream: str, returns: str
) -> None:
    # The user's function raises, or returns what is no subject, for one event: that event
    # fails alone, the others of its wave go out (a raise used to fail the whole wave). A raise
    # may be a lookup failing for a moment: retried as any failed publish (NamingFailed, a
    # PublishError); a return that is no subject is the event's own fault (InvalidEventError,
    # parked at once).
    def subject(e: Event) -> Any:
        if "bad" not in e.headers:
            return f"{nats_stream}.ok"
        if returns == "raises":
            return e.headers["region"]
        return {"none": None, "int": 42, "empty": ""}[returns]

    good, bad, also_good = event(), event(headers={"bad": "1"}), event()
    publisher = NatsPublisher(nats_client.jetstream(), subject=subject)
    results = await publisher.publish_many([good, bad, also_good])
    assert results[0] is None and results[2] is None, results
    expected = NamingFailed if returns == "raises" else InvalidEventError
    assert type(results[1]) is expected and results[1].event_id == bad.id
    assert "naming function 'subject'" in str(results[1])
    messages = await read_stream(nats_client, nats_stream, 2)
    assert {m.headers["Nats-Msg-Id"] for m in messages} == {good.id, also_good.id}


async def test_nats_aclose_closes_only_what_connect_opened(
    nats_client: Any, nats_stream: str
) -> None:
    owned = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    borrowed = NatsPublisher(nats_client.jetstream(), subject=f"{nats_stream}.{{type}}")
    await owned.publish(event())
    await borrowed.publish(event())
    assert owned.connection is not None and owned.connection.is_connected
    assert borrowed.connection is None
    for publisher in (owned, borrowed):
        await publisher.aclose()
        await publisher.aclose()  # idempotent
        with pytest.raises(PublishError, match="closed"):
            await publisher.publish(event())
        [result] = await publisher.publish_many([event()])
        assert isinstance(result, PublishError)
    assert owned.connection.is_closed
    assert nats_client.is_connected  # the caller's connection is the caller's to close
    await read_stream(nats_client, nats_stream, 2)


async def test_nats_publishes_overlap_and_keep_per_aggregate_order(
    nats_client: Any, nats_stream: str
) -> None:
    nc = Unacked(nats_client)
    js = nats_client.jetstream()
    publisher = NatsPublisher(js, subject=f"{nats_stream}.{{aggregate_type}}")
    sent = waves(aggregates=100, per_aggregate=5)
    for wave in sent:  # as the relay drives a BatchPublisher
        assert await publisher.publish_many(wave) == [None] * len(wave)
    # A wave's acks were awaited together, not one round trip each: its messages go to the
    # server in hand-overs of 64, the rest built while the server stores those.
    assert nc.peak >= 64
    nc.peak = 0
    for wave in sent:  # the same events again, through publish: the stream drops them
        await asyncio.gather(*(publisher.publish(e) for e in wave))
    assert nc.peak > 1
    messages = await read_stream(nats_client, nats_stream, 500)
    received = [Event.from_json(m.data) for m in messages]
    assert_in_order(received, [e for wave in sent for e in wave], once=True)


async def test_nats_connect_fails_loudly_when_the_server_is_not_there() -> None:
    with pytest.raises(ConnectionError):
        await NatsPublisher.connect("nats://127.0.0.1:1", timeout=0.5)


# --- RabbitMQ ----------------------------------------------------------------------------


async def test_rabbitmq_message_is_persistent_json_and_carries_the_id(
    channel: Any, unique: str
) -> None:
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    queue = await bind_queue(channel, unique)
    sent = event()
    await publisher.publish(sent)
    await publisher.aclose()
    [message] = await drain_queue(queue, 1)
    assert Event.from_json(message.body) == sent
    assert message.message_id == sent.id
    assert message.routing_key == "order.placed"
    assert message.exchange == unique
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.content_type == "application/json"
    assert message.type == "order.placed"
    assert message.correlation_id == "corr-1"
    assert message.timestamp == sent.occurred_at.replace(microsecond=0)
    assert message.headers == {
        "event-type": "order.placed",
        "aggregate-type": "orders",
        "aggregate-id": "7",
        "sequence": "3",
        "tenant": "acme",
        "trace": "t-1",
    }


async def test_rabbitmq_connect_declares_a_durable_topic_exchange(
    channel: Any, unique: str
) -> None:
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    await publisher.aclose()
    # Redeclaring with the same settings is accepted; any other settings are refused.
    await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
        await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=False)


async def test_rabbitmq_routes_by_the_configured_key(channel: Any, unique: str) -> None:
    publisher = await RabbitMQPublisher.connect(
        RABBITMQ_URL, exchange=unique, routing_key="{aggregate_type}.{type}"
    )
    orders = await bind_queue(channel, unique, "orders.#")
    placed, paid = event(), event(type="order.paid")
    await publisher.publish(placed)
    await publisher.publish(paid)
    await publisher.aclose()
    messages = await drain_queue(orders, 2)
    assert [m.routing_key for m in messages] == ["orders.order.placed", "orders.order.paid"]
    assert [m.message_id for m in messages] == [placed.id, paid.id]


async def test_rabbitmq_a_message_over_max_message_size_fails_alone_before_it_is_sent(
    channel: Any, unique: str
) -> None:
    # Sent, it would close the channel (PRECONDITION_FAILED) and fail the others of its wave.
    publisher = await RabbitMQPublisher.connect(
        RABBITMQ_URL, exchange=unique, max_message_size=2000
    )
    queue = await bind_queue(channel, unique)
    small, big, also_small = event(), event(payload={"blob": "x" * 3000}), event()
    results = await publisher.publish_many([small, big, also_small])
    await publisher.aclose()
    assert results[0] is None and results[2] is None, results
    assert isinstance(results[1], InvalidEventError) and results[1].event_id == big.id
    assert "over max_message_size 2000" in str(results[1])
    messages = await drain_queue(queue, 2)
    assert [m.message_id for m in messages] == [small.id, also_small.id]
    with pytest.raises(ConfigurationError, match="max_message_size must be >= 1"):
        RabbitMQPublisher(publisher.exchange, max_message_size=0)
    # Refused before connecting (nothing listens on port 1): no connection left reconnecting.
    with pytest.raises(ConfigurationError, match="max_message_size must be >= 1"):
        await RabbitMQPublisher.connect("amqp://guest:guest@127.0.0.1:1/", max_message_size=0)


async def test_rabbitmq_unroutable_message_is_an_error_not_a_drop(
    channel: Any, unique: str
) -> None:
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    lost = event()
    # No queue bound: waiting for one is the relay's to do, so it parks nothing.
    with pytest.raises(BrokerUnavailableError, match="NO_ROUTE") as raised:
        await publisher.publish(lost)
    assert isinstance(raised.value.__cause__, aio_pika.exceptions.DeliveryError)
    # The channel survives a returned message: once a queue is bound the retry goes through.
    queue = await bind_queue(channel, unique)
    await publisher.publish(lost)
    await publisher.aclose()
    [message] = await drain_queue(queue, 1)
    assert message.message_id == lost.id


async def test_rabbitmq_confirms_on_its_own_channel_whatever_the_exchanges_channel_does(
    amqp_connection: Any, channel: Any, unique: str
) -> None:
    # The publisher publishes on a confirming channel of its own (mandatory, returns raised),
    # so an exchange looked up on a channel without confirms still gets a confirm per event.
    unconfirmed = await amqp_connection.channel(publisher_confirms=False)
    confirms_only = await amqp_connection.channel(publisher_confirms=True, on_return_raises=False)
    try:
        for ch in (unconfirmed, confirms_only):
            exchange = await ch.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
            with pytest.raises(BrokerUnavailableError, match="NO_ROUTE"):
                await RabbitMQPublisher(exchange).publish(event())  # unroutable, so never kept
        queue = await bind_queue(channel, unique)
        sent = event()
        await RabbitMQPublisher(exchange).publish(sent)
        [message] = await drain_queue(queue, 1)
        assert message.message_id == sent.id
    finally:
        await confirms_only.exchange_delete(unique)
        await unconfirmed.close()
        await confirms_only.close()


async def test_rabbitmq_aclose_closes_only_what_connect_opened(
    amqp_connection: Any, channel: Any, unique: str
) -> None:
    owned = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    queue = await bind_queue(channel, unique)
    confirming = await amqp_connection.channel(publisher_confirms=True, on_return_raises=True)
    borrowed = RabbitMQPublisher(await confirming.get_exchange(unique))
    await owned.publish(event())
    channels = (await confirming.get_underlay_channel()).connection.channels
    before = set(channels)
    await borrowed.publish(event())  # on a channel of its own, which aclose closes
    [own] = set(channels) - before
    assert borrowed.connection is None
    for publisher in (owned, borrowed):
        await publisher.aclose()
        await publisher.aclose()  # idempotent
        with pytest.raises(PublishError, match="closed"):
            await publisher.publish(event())
    assert owned.connection is not None and owned.connection.is_closed
    assert own not in channels
    assert not confirming.is_closed and not amqp_connection.is_closed
    await confirming.close()
    await drain_queue(queue, 2)


async def test_rabbitmq_publishes_a_wave_in_one_write_and_keeps_per_aggregate_order(
    amqp_connection: Any, channel: Any, unique: str
) -> None:
    queue = await bind_queue(channel, unique)
    confirming = await amqp_connection.channel(publisher_confirms=True, on_return_raises=True)
    # The publisher opens its own channel on the exchange channel's connection: count there.
    underlay = await confirming.get_underlay_channel()
    writes = Writes(underlay.connection)

    async def counted() -> Any:
        return Proxy(underlay, connection=writes)

    confirming.get_underlay_channel = counted
    publisher = RabbitMQPublisher(await confirming.get_exchange(unique))
    assert isinstance(publisher, BatchPublisher)
    sent = waves(aggregates=100, per_aggregate=5)
    for wave in sent:  # as the relay does: one event per aggregate at a time
        assert await publisher.publish_many(wave[:1]) == [None]
        # The rest of the wave, 99 events, goes out as one write, before any confirm is
        # awaited.
        before = writes.count
        assert await publisher.publish_many(wave[1:]) == [None] * (len(wave) - 1)
        assert writes.count == before + 1
    await confirming.close()
    received = [Event.from_json(m.body) for m in await drain_queue(queue, 500)]
    assert_in_order(received, [e for wave in sent for e in wave], once=True)


async def test_rabbitmq_connect_fails_loudly_when_the_server_is_not_there() -> None:
    with pytest.raises(ConnectionError):  # aio-pika's AMQPConnectionError is a ConnectionError
        await RabbitMQPublisher.connect("amqp://guest:guest@127.0.0.1:1/", timeout=0.5)


@contextlib.asynccontextmanager
async def _silent_server() -> AsyncIterator[int]:
    """A TCP server that accepts and never answers: a broker that hangs in the handshake."""
    accepted: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


def _reconnectors(before: set[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    """aio-pika's reconnecting tasks started since ``before``."""
    return [
        task
        for task in asyncio.all_tasks() - before
        if "connection_factory" in task.get_coro().__qualname__  # type: ignore[union-attr]
    ]


@pytest.mark.parametrize("ends", ["timeout", "cancel"])
async def test_rabbitmq_connect_that_does_not_finish_leaves_no_reconnecting_task(
    ends: str,
) -> None:
    # aio-pika's robust connection reconnects from a task that survives cancellation: a
    # cancelled connect (a relay stopped while it connects) once left it retrying forever. On
    # Python 3.10 a connect that timed out did too (the timeout case guards that one).
    before = asyncio.all_tasks()
    async with _silent_server() as port:
        url = f"amqp://guest:guest@127.0.0.1:{port}/"
        connecting = asyncio.ensure_future(RabbitMQPublisher.connect(url, timeout=0.5))
        if ends == "cancel":
            await asyncio.sleep(0.2)
            connecting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await connecting
        else:
            with pytest.raises(ConnectionError, match=r"RabbitMQ at .*: no answer within 0.5s"):
                await connecting
        await asyncio.sleep(0)
        assert _reconnectors(before) == []
