"""What each publisher raises when things go wrong, against its real broker: the kind of error
decides what the relay does (an outage or a full broker is retried without counting an
attempt, an event no broker can carry is parked at once), so each failure is checked for its
kind, and for the publisher being usable afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import nats
import nats.js.errors
import pamqp.frame
import pamqp.header
import pytest
from nats.js.api import DiscardPolicy

from mongo_outbox import (
    BrokerFullError,
    BrokerUnavailableError,
    Event,
    InvalidEventError,
    PublishError,
)
from mongo_outbox.brokers.rabbitmq._confirms import UNCONFIRMED_BYTES
from mongo_outbox.errors import unavailable
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import NatsPublisher, RabbitMQPublisher
from tests.support.brokers import HAVE_NATS_SERVER, Broker, Gate
from tests.support.messages import bind_queue, drain_queue, event, read_stream
from tests.support.servers import NATS_URL, RABBITMQ_URL
from tests.support.waiting import eventually, until


@pytest.fixture
async def private_nats(tmp_path: Path) -> AsyncIterator[Broker]:
    """A nats-server of the test's own, with a user and password, that the test may kill."""
    if not HAVE_NATS_SERVER:
        pytest.skip("needs the nats-server binary to run a broker of the test's own")
    server = Broker(tmp_path, "--user", "relay", "--pass", "s3cr3t-pw")
    await server.start()
    yield server
    if server.process and server.process.returncode is None:
        await server.kill()


def credentials_url(server: Broker) -> str:
    return f"nats://relay:s3cr3t-pw@127.0.0.1:{server.port}"


# --- RabbitMQ: missing exchange -----------------------------------------------------------


async def test_rabbitmq_missing_exchange_is_an_outage_and_publishing_resumes(
    channel: Any, unique: str
) -> None:
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique, timeout=2)
    queue = await bind_queue(channel, unique)
    try:
        await publisher.publish(event())
        await channel.exchange_delete(unique)  # an operator's mistake: gone, with its bindings
        lost = event()
        with pytest.raises(BrokerUnavailableError, match="NOT_FOUND") as raised:
            await publisher.publish(lost)
        assert isinstance(raised.value.__cause__, aiormq.exceptions.ChannelNotFoundEntity)
        assert raised.value.event_id == lost.id and unavailable(raised.value)
        # The broker closed the channel; once the exchange and its binding are back, the
        # same publisher delivers the event (until then every failure is an outage).
        queue = await bind_queue(channel, unique)
        await eventually(lambda: publisher.publish(lost))
    finally:
        await publisher.aclose()
    messages = await drain_queue(queue, 1)
    assert [m.message_id for m in messages] == [lost.id]


@pytest.mark.parametrize("connect", [aio_pika.connect, aio_pika.connect_robust])
async def test_rabbitmq_channel_closed_for_a_missing_exchange_is_reopened(
    channel: Any, unique: str, connect: Callable[..., Awaitable[Any]]
) -> None:
    # A borrowed exchange, looked up (not declared) on the caller's own confirming channel:
    # aio-pika never reopens a plain channel, and cannot restore a robust one while the
    # exchange is missing.
    queue = await bind_queue(channel, unique)
    connection = await connect(RABBITMQ_URL)
    try:
        confirming = await connection.channel(publisher_confirms=True, on_return_raises=True)
        publisher = RabbitMQPublisher(await confirming.get_exchange(unique), timeout=2)
        await channel.exchange_delete(unique)
        for _ in range(3):  # the channel is reopened each time, and closed again by the 404
            with pytest.raises(BrokerUnavailableError):
                await publisher.publish(event())
        sent = event()
        queue = await bind_queue(channel, unique)
        await eventually(lambda: publisher.publish(sent))
        [message] = await drain_queue(queue, 1)
        assert message.message_id == sent.id
    finally:
        await connection.close()


async def test_rabbitmq_waves_waiting_when_the_broker_closes_the_channel_are_never_written(
    channel: Any, unique: str
) -> None:
    # A wave written after the broker closed the channel (and aiormq answered Close-Ok) would
    # reach a channel the broker no longer has: it closes the whole connection for that
    # (CHANNEL_ERROR, "expected 'channel.open'"), the caller's own, and a plain one stays closed.
    await bind_queue(channel, unique)
    connection = await aio_pika.connect(RABBITMQ_URL)
    try:
        confirming = await connection.channel(publisher_confirms=True, on_return_raises=True)
        publisher = RabbitMQPublisher(await confirming.get_exchange(unique), timeout=5)
        assert await publisher.publish_many([event()]) == [None]  # its channel is open
        await channel.exchange_delete(unique)
        large = {"data": "x" * (UNCONFIRMED_BYTES * 5 // 8)}
        # The first wave closes the channel (404); the second waits for the first's confirms
        # (together they are over the bound), and the third waits for the second.
        waves = [[event(payload=large)], [event(payload=large)], [event()]]
        outcomes = await asyncio.gather(*(publisher.publish_many(wave) for wave in waves))
        assert all(isinstance(r, BrokerUnavailableError) for rs in outcomes for r in rs)
        await asyncio.sleep(0.5)  # the broker's answer to anything written meanwhile
        await (await connection.channel()).close()  # the caller's connection is still open
        queue = await bind_queue(channel, unique)
        sent = event()
        await eventually(lambda: publisher.publish(sent))
        [message] = await drain_queue(queue, 1)
        assert message.message_id == sent.id
    finally:
        await connection.close()


# --- RabbitMQ: closing while publishing --------------------------------------------------


async def test_rabbitmq_aclose_fails_publishes_in_flight_as_closed_not_cancelled(
    channel: Any, unique: str
) -> None:
    # aiormq 6 (Python 3.10) leaves some publishes waiting for their timeout after a close.
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique, timeout=1)
    await bind_queue(channel, unique)
    tasks = [asyncio.create_task(publisher.publish(event(sequence=n))) for n in range(1, 201)]
    # As soon as one is confirmed others are on the wire, awaiting theirs.
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    await publisher.aclose()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert not [t for t in tasks if t.cancelled()]
    failures = [r for r in results if r is not None]
    assert failures and all(isinstance(f, BrokerUnavailableError) for f in failures)
    assert all("closed" in str(f) for f in failures)


async def test_a_publish_cancelled_by_its_caller_is_still_cancelled(
    channel: Any, unique: str
) -> None:
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    await bind_queue(channel, unique)
    try:
        # A relay's publish_timeout: the caller gives up, and its cancellation stays its own.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(publisher.publish(event()), 0.0001)
        task = asyncio.create_task(publisher.publish(event()))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await publisher.publish(event())  # and the channel is fine afterwards
    finally:
        await publisher.aclose()


# --- RabbitMQ: full queue ------------------------------------------------------------------


async def test_rabbitmq_nack_from_a_full_queue_is_broker_full(channel: Any, unique: str) -> None:
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(
        exclusive=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
    )
    await queue.bind(exchange, "#")
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    try:
        first, second = event(sequence=1), event(sequence=2)
        await publisher.publish(first)
        with pytest.raises(BrokerFullError) as raised:
            await publisher.publish(second)
        assert isinstance(raised.value.__cause__, aiormq.exceptions.DeliveryError)
        assert raised.value.event_id == second.id and unavailable(raised.value)
        assert [m.message_id for m in await drain_queue(queue, 1)] == [first.id]
        await publisher.publish(second)  # room again: the same channel takes it
        assert [m.message_id for m in await drain_queue(queue, 1)] == [second.id]
    finally:
        await publisher.aclose()


# --- RabbitMQ: what a connection cannot carry ----------------------------------------------


async def test_rabbitmq_refuses_headers_over_frame_max_and_the_connection_lives_on(
    channel: Any, unique: str
) -> None:
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    queue = await bind_queue(channel, unique)
    underlay = await publisher.exchange.channel.get_underlay_channel()
    frame_max = underlay.connection.connection_tune.frame_max

    def sized(padding: int) -> tuple[Event, int]:
        sent = event(headers={"pad": "p" * padding})
        properties = aio_pika.Message(
            sent.model_dump_json().encode(),
            message_id=sent.id,
            type=sent.type,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            timestamp=sent.occurred_at,
            correlation_id=sent.correlation_id,
            headers={
                **sent.headers,
                "event-type": sent.type,
                "aggregate-type": str(sent.aggregate_type),
                "aggregate-id": str(sent.aggregate_id),
                "sequence": str(sent.sequence),
            },
        )
        header = pamqp.header.ContentHeader(0, len(properties.body), properties.properties)
        return sent, len(pamqp.frame.marshal(header, underlay.number))

    _, base = sized(0)
    fits, size = sized(frame_max - base)
    assert size == frame_max
    too_big, size = sized(frame_max - base + 1)
    assert size == frame_max + 1
    huge = event(headers={"pad": "p" * 200_000})
    try:
        before, after = event(sequence=1), event(sequence=2)
        results = await asyncio.gather(
            publisher.publish(before),
            publisher.publish(huge),
            publisher.publish(too_big),
            publisher.publish(after),
            return_exceptions=True,
        )
        assert results[0] is None and results[3] is None
        for refused, result in ((huge, results[1]), (too_big, results[2])):
            assert isinstance(result, InvalidEventError), result
            assert result.event_id == refused.id and "frame_max" in str(result)
        await publisher.publish(fits)  # exactly frame_max: the frame goes, on the same connection
    finally:
        await publisher.aclose()
    messages = await drain_queue(queue, 3)
    assert {m.message_id for m in messages[:2]} == {before.id, after.id}
    assert messages[2].message_id == fits.id


async def test_rabbitmq_refuses_a_type_or_header_name_amqp_would_cut(
    channel: Any, unique: str
) -> None:
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique, routing_key="k")
    queue = await bind_queue(channel, unique)
    try:
        # pamqp would cut a header name to 128 bytes without a word.
        for refused in (event(type="é" * 128), event(headers={"h" * 129: "v"})):
            with pytest.raises(InvalidEventError, match="longer than") as raised:
                await publisher.publish(refused)
            assert raised.value.event_id == refused.id
        longest = event(type="é" * 127, headers={"h" * 128: "v"})
        await publisher.publish(longest)
    finally:
        await publisher.aclose()
    [message] = await drain_queue(queue, 1)
    assert message.type == "é" * 127 and message.headers["h" * 128] == "v"


class Shouting(str):
    """A routing key whose encoding fails: what a user's naming function may return."""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        raise UnicodeError("cannot encode this key")


async def test_rabbitmq_an_event_it_cannot_encode_fails_alone_and_its_wave_goes_out(
    channel: Any, unique: str
) -> None:
    def naming(sent: Event) -> str:
        routes = {"a": "k.a", "odd": Shouting("k.odd")}
        return routes[sent.type]  # a KeyError for any other type

    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique, routing_key=naming)
    queue = await bind_queue(channel, unique)
    landing = datetime(1969, 7, 20, 20, 17, 40, tzinfo=timezone.utc)
    innocent = [event(type="a", aggregate_id=n) for n in range(4)]
    old, unknown, odd = event(type="a", occurred_at=landing), event(type="b"), event(type="odd")
    try:
        results = await publisher.publish_many([*innocent[:2], old, unknown, odd, *innocent[2:]])
    finally:
        await publisher.aclose()
    assert results[:3] == [None] * 3 and results[5:] == [None] * 2
    assert isinstance(results[3], PublishError) and "KeyError" in str(results[3])
    assert isinstance(results[4], PublishError) and not isinstance(results[4], InvalidEventError)
    assert "cannot be encoded" in str(results[4]) and "UnicodeError" in str(results[4])
    assert (results[3].event_id, results[4].event_id) == (unknown.id, odd.id)
    messages = await drain_queue(queue, 5)
    assert {m.message_id for m in messages} == {e.id for e in [*innocent, old]}
    [before_1970] = [m for m in messages if m.message_id == old.id]
    # AMQP's timestamp is unsigned: left out; the body still says when it occurred.
    assert before_1970.timestamp is None
    assert Event.from_json(before_1970.body).occurred_at == landing
    assert all(m.timestamp is not None for m in messages if m.message_id != old.id)


async def test_rabbitmq_connect_error_hides_the_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConnectionError) as raised:
        await RabbitMQPublisher.connect("amqp://guest:s3cr3t-pw@127.0.0.1:1/", timeout=0.5)
    assert "amqp://guest:***@127.0.0.1:1/" in str(raised.value)
    shown = [str(raised.value), repr(raised.value), caplog.text]
    shown += [str(raised.value.__cause__), repr(raised.value.__cause__)]
    assert not [text for text in shown if "s3cr3t-pw" in text]


# --- NATS: full stream ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "description"),
    [
        ({"max_msgs": 1}, "maximum messages exceeded"),
        ({"max_bytes": 900}, "maximum bytes exceeded"),  # one message takes about 580
        (
            {"max_msgs_per_subject": 1, "discard_new_per_subject": True},
            "maximum messages per subject exceeded",
        ),
    ],
)
async def test_nats_full_stream_is_broker_full(
    nats_client: Any, unique: str, limits: dict[str, Any], description: str
) -> None:
    js = nats_client.jetstream()
    await js.add_stream(name=unique, subjects=[f"{unique}.>"], discard=DiscardPolicy.NEW, **limits)
    try:
        publisher = NatsPublisher(js, subject=f"{unique}.{{type}}", timeout=5)
        first, second = event(sequence=1), event(sequence=2)
        await publisher.publish(first)
        with pytest.raises(BrokerFullError, match=description) as raised:
            await publisher.publish(second)
        cause = raised.value.__cause__
        assert isinstance(cause, nats.js.errors.APIError)
        assert (cause.err_code, cause.description) == (10077, description)  # the real server's
        assert raised.value.event_id == second.id and unavailable(raised.value)
        [result] = await publisher.publish_many([second])
        assert isinstance(result, BrokerFullError)
        await js.purge_stream(unique)
        await publisher.publish(second)  # room again
        [message] = await read_stream(nats_client, unique, 1)
        assert message.headers["Nats-Msg-Id"] == second.id
    finally:
        await js.delete_stream(unique)


async def test_nats_server_out_of_jetstream_storage_is_broker_full(tmp_path: Path) -> None:
    if not HAVE_NATS_SERVER:
        pytest.skip("needs the nats-server binary to run a broker of the test's own")
    config = tmp_path / "limits.conf"
    config.write_text("jetstream { max_file_store: 65536, max_memory_store: 65536 }\n")
    server = Broker(tmp_path / "store", "-c", str(config))
    await server.start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="orders", subjects=["orders.>"])  # no limits of its own
        publisher = NatsPublisher(js, subject="orders.{type}", timeout=5)
        stored = 0
        with pytest.raises(BrokerFullError, match="insufficient resources") as raised:
            for stored in range(200):  # noqa: B007 - counted to check the server took some
                await publisher.publish(event(payload={"pad": "p" * 1000}))
        assert stored > 10
        cause = raised.value.__cause__
        assert isinstance(cause, nats.js.errors.APIError) and cause.err_code == 10023
        await nc.close()
    finally:
        await server.kill()


async def test_nats_missing_stream_stays_an_outage(nats_client: Any, unique: str) -> None:
    js = nats_client.jetstream()
    publisher = NatsPublisher(js, subject=f"{unique}.{{type}}", timeout=5)
    await js.add_stream(name=unique, subjects=[f"{unique}.>"])
    await publisher.publish(event())
    await js.delete_stream(unique)  # gone mid-run
    with pytest.raises(BrokerUnavailableError) as raised:
        await publisher.publish(event())
    assert type(raised.value) is BrokerUnavailableError  # an outage, not a full stream
    assert isinstance(raised.value.__cause__, nats.js.errors.NoStreamResponseError)


# --- NATS: what a connection cannot carry -------------------------------------------------


def nats_sizes(sent: Event) -> tuple[int, int]:
    """The header block as the NATS protocol frames it (HPUB), and the body's size."""
    headers = {
        **sent.headers,
        "event-type": sent.type,
        "aggregate-type": str(sent.aggregate_type),
        "aggregate-id": str(sent.aggregate_id),
        "sequence": str(sent.sequence),
        "Nats-Msg-Id": sent.id,
        "Content-Type": "application/json",
    }
    block = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return len(block.encode()), len(sent.model_dump_json().encode())


async def test_nats_refuses_headers_over_jetstreams_64_kb_before_sending(
    nats_client: Any, nats_stream: str
) -> None:
    publisher = NatsPublisher(nats_client.jetstream(), subject=f"{nats_stream}.{{type}}")
    base, _ = nats_sizes(event(headers={"pad": ""}))
    fits = event(headers={"pad": "p" * (65535 - base)})
    too_big = event(headers={"pad": "p" * (65536 - base)})
    assert [nats_sizes(e)[0] for e in (fits, too_big)] == [65535, 65536]
    with pytest.raises(InvalidEventError, match="headers") as raised:
        await publisher.publish(too_big)
    assert raised.value.event_id == too_big.id
    await publisher.publish(fits)
    [message] = await read_stream(nats_client, nats_stream, 1)
    assert message.headers["Nats-Msg-Id"] == fits.id


async def test_nats_refuses_a_message_over_max_payload_and_stays_connected(
    nats_client: Any, nats_stream: str
) -> None:
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    assert publisher.connection is not None
    limit = publisher.connection.max_payload
    # One date for the three: pydantic writes one on a whole second without its fraction, 7
    # bytes fewer (a clock that read .000 for one of them failed this test in a CI run).
    at = {"occurred_at": utc_now().replace(microsecond=123_000), "headers": {}}
    header, body = nats_sizes(event(payload={"pad": ""}, **at))
    fits = event(payload={"pad": "p" * (limit - header - body)}, **at)
    too_big = event(payload={"pad": "p" * (limit - header - body + 1)}, **at)
    assert [sum(nats_sizes(e)) for e in (fits, too_big)] == [limit, limit + 1]
    try:
        with pytest.raises(InvalidEventError, match="max_payload") as raised:
            await publisher.publish(too_big)
        assert raised.value.event_id == too_big.id
        await publisher.publish(fits)  # exactly max_payload, on the same connection
        assert publisher.connection.is_connected
        assert publisher.connection.stats["reconnects"] == 0
    finally:
        await publisher.aclose()
    [message] = await read_stream(nats_client, nats_stream, 1)
    assert message.headers["Nats-Msg-Id"] == fits.id


async def test_a_nats_rollup_header_is_refused_before_it_can_wipe_the_subject(
    nats_client: Any, unique: str
) -> None:
    js = nats_client.jetstream()
    await js.add_stream(name=unique, subjects=[f"{unique}.>"], allow_rollup_hdrs=True)
    try:
        publisher = NatsPublisher(js, subject=f"{unique}.orders")
        earlier = event(sequence=1)
        await publisher.publish(earlier)
        for name in ("Nats-Rollup", "nats-expected-last-sequence", "NATS-MSG-ID"):
            with pytest.raises(InvalidEventError, match="reserved"):
                await publisher.publish(event(sequence=2, headers={name: "sub"}))
        [message] = await read_stream(nats_client, unique, 1)
        assert message.headers["Nats-Msg-Id"] == earlier.id
    finally:
        await js.delete_stream(unique)


# --- NATS: credentials and closing during an outage ----------------------------------------


async def test_nats_connect_error_hides_credentials(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = "nats://relay:s3cr3t-pw@127.0.0.1:1,nats://t0ken-s3cr3t@127.0.0.1:2"
    with pytest.raises(ConnectionError) as raised:
        await NatsPublisher.connect(url, timeout=0.5)
    assert "nats://relay:***@127.0.0.1:1,nats://***@127.0.0.1:2" in str(raised.value)
    assert caplog.records  # the failed attempts were logged
    for text in (str(raised.value), repr(raised.value), caplog.text):
        assert "s3cr3t" not in text


async def test_nats_logs_hide_credentials_when_the_server_goes_away(
    private_nats: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    publisher = await NatsPublisher.connect(credentials_url(private_nats), timeout=1)
    try:
        await private_nats.kill()
        deadline = time.monotonic() + 10
        while not [r for r in caplog.records if r.name == "mongo_outbox.brokers.nats.publisher"]:
            assert time.monotonic() < deadline, "the lost connection was never logged"
            await asyncio.sleep(0.05)
    finally:
        await publisher.aclose()
    assert f"nats://relay:***@127.0.0.1:{private_nats.port}" in caplog.text
    assert "s3cr3t-pw" not in caplog.text


async def test_nats_aclose_during_an_outage_succeeds_and_twice(private_nats: Broker) -> None:
    nc = await nats.connect(credentials_url(private_nats))
    await nc.jetstream().add_stream(name="orders", subjects=["orders.>"])
    await nc.close()
    publisher = await NatsPublisher.connect(
        credentials_url(private_nats), subject="orders.{type}", timeout=0.5
    )
    await publisher.publish(event())
    await private_nats.kill()
    for _ in range(2):  # buffered by the client while it reconnects, never confirmed
        with pytest.raises((BrokerUnavailableError, asyncio.TimeoutError)) as raised:
            await publisher.publish(event())
        assert unavailable(raised.value)
    assert publisher.connection is not None and not publisher.connection.is_connected
    await publisher.aclose()
    await publisher.aclose()
    assert publisher.connection.is_closed
    with pytest.raises(BrokerUnavailableError, match="closed"):
        await publisher.publish(event())


async def test_nats_aclose_fails_publishes_in_flight_as_closed_not_cancelled(
    nats_stream: str,
) -> None:
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{nats_stream}.{{type}}")
    tasks = [asyncio.create_task(publisher.publish(event(sequence=n))) for n in range(1, 201)]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    await publisher.aclose()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert not [t for t in tasks if t.cancelled()]
    assert all(r is None or unavailable(r) for r in results), {type(r) for r in results}
    with contextlib.suppress(BrokerUnavailableError):
        await publisher.publish(event())


class _FakeNats:
    """A fake NATS server (no real one can be made to do this on cue): it completes the
    handshake, then never reads again. What the client writes after that stays in its
    socket's buffer, so whatever waits for that socket to take it or to close waits for ever.
    ``cut()`` sends the client an end of file and refuses new connections."""

    def __init__(self) -> None:
        self.accepted: list[asyncio.StreamWriter] = []
        self._cut = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        self._cut.set()

    def close(self) -> None:
        for writer in self.accepted:
            writer.transport.abort()
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted.append(writer)
        info = b'{"server_id":"fake","version":"2.10.0","headers":true,"max_payload":67108864}'
        writer.write(b"INFO " + info + b"\r\n")
        seen = b""
        while b"PING\r\n" not in seen:
            seen += await reader.read(4096)
        writer.write(b"PONG\r\n")
        await self._cut.wait()
        writer.write_eof()


@contextlib.asynccontextmanager
async def _stuck_publisher() -> AsyncIterator[
    tuple[_FakeNats, NatsPublisher, Any, asyncio.Transport]
]:
    """A publisher connected to a ``_FakeNats`` with 32 MiB it can never hand over, and the
    client's socket transport that holds them."""
    fake = _FakeNats()
    publisher = await NatsPublisher.connect(f"nats://127.0.0.1:{await fake.start()}", timeout=1)
    nc = publisher.connection
    assert nc is not None
    # Not awaited: nats-py flushes a publish this size at once, and waits for the socket.
    stuck = asyncio.ensure_future(nc.publish("x", bytes(32 << 20)))
    try:
        socket = nc._transport._io_writer.transport
        # All of it handed to the socket, which holds what the kernel did not take.
        await until(lambda: nc.pending_data_size == 0 and socket.get_write_buffer_size() > 0)
        yield fake, publisher, nc, socket
    finally:
        fake.close()
        stuck.cancel()
        with contextlib.suppress(BaseException):
            await stuck


async def test_nats_aclose_while_the_client_reconnects_from_a_stuck_socket_does_not_raise() -> None:
    # nats-py's close cancels its reconnection, which waits on the very future the close then
    # awaits: a CancelledError nobody asked for (a CI run on 3.10 met it at random).
    async with _stuck_publisher() as (fake, publisher, nc, _):
        fake.cut()
        await until(lambda: nc.is_reconnecting)
        await asyncio.sleep(0.1)  # the reconnection is now waiting for the socket to close
        await publisher.aclose()
        assert nc.is_closed


async def test_nats_aclose_returns_and_drops_the_socket_when_the_server_stops_reading(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A hung server (stopped, or behind a stuck proxy) used to hold aclose, and so a relay's
    # stop, for ever: nats-py's drain and close wait for the socket to take its buffer.
    async with _stuck_publisher() as (_, publisher, nc, socket):
        started = time.monotonic()
        await publisher.aclose()
        assert time.monotonic() - started < 2 * publisher.timeout + 1
        assert nc.is_closed
        # Dropped, not closed gracefully: a graceful close would keep the buffer, and the
        # socket, until the server reads it.
        assert socket.is_closing() and socket.get_write_buffer_size() == 0
        assert "its socket is dropped" in caplog.text


# --- RabbitMQ: a wave's confirms, one by one -----------------------------------------------


async def test_rabbitmq_wave_maps_each_event_to_its_own_confirm_nack_or_return(
    channel: Any, unique: str
) -> None:
    # One write, one window of confirms: each event still gets its own outcome.
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(
        exclusive=True, arguments={"x-max-length": 2, "x-overflow": "reject-publish"}
    )
    await queue.bind(exchange, "kept.#")
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    wave = [
        event(type="kept.a", aggregate_id=1),
        event(type="lost.b", aggregate_id=2),  # no queue bound: returned
        event(type="kept.c", aggregate_id=3),
        event(type="é" * 128, aggregate_id=4),  # AMQP cannot carry its type: never sent
        event(type="kept.d", aggregate_id=5),  # the queue is full: nacked
        event(type="kept.e", aggregate_id=6),  # and so on, every event after it
    ]
    try:
        results = await publisher.publish_many(wave)
    finally:
        await publisher.aclose()
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], BrokerUnavailableError) and "NO_ROUTE" in str(results[1])
    assert isinstance(results[1].__cause__, aiormq.exceptions.PublishError)
    assert isinstance(results[3], InvalidEventError)
    for full in results[4:]:
        assert isinstance(full, BrokerFullError)
        assert isinstance(full.__cause__, aiormq.exceptions.DeliveryError)
    assert [r.event_id for r in results if r is not None] == [wave[i].id for i in (1, 3, 4, 5)]
    assert [m.message_id for m in await drain_queue(queue, 2)] == [wave[0].id, wave[2].id]


# --- RabbitMQ: the connection dropped mid-wave -----------------------------------------------


class CutAtFirstReply(Gate):
    """A ``Gate`` that, once ``armed``, passes on the broker's next reply and then drops every
    connection: the client has some of its confirms, and the rest are lost in the cut."""

    armed = False

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream = await asyncio.open_connection(*self.target)
        self.writers |= {writer, upstream}

        async def copy(
            source: asyncio.StreamReader, sink: asyncio.StreamWriter, replies: bool
        ) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
                    if replies and self.armed:
                        self.armed = False
                        for cut in self.writers:
                            cut.transport.abort()
            sink.transport.abort()

        await asyncio.gather(copy(reader, upstream, False), copy(upstream_reader, writer, True))
        self.writers -= {writer, upstream}


async def test_rabbitmq_connection_cut_mid_wave_is_an_outage_and_publishing_resumes(
    channel: Any, unique: str
) -> None:
    queue = await bind_queue(channel, unique)
    gate = CutAtFirstReply()
    await gate.start()
    publisher = await RabbitMQPublisher.connect(gate.url, exchange=unique, timeout=2)
    wave = [event(aggregate_id=n, sequence=1) for n in range(3_000)]
    try:
        assert await publisher.publish_many(wave[:1]) == [None]  # the channel is open
        # The cut comes with the broker's first confirms of the wave.
        gate.armed = True
        results = await publisher.publish_many(wave)
        assert not gate.armed, "the connection was not cut"
        failed = [e for e, result in zip(wave, results, strict=True) if result is not None]
        assert failed, "the whole wave was confirmed before the cut"
        assert all(isinstance(r, BrokerUnavailableError) for r in results if r is not None), {
            repr(r) for r in results if r is not None
        }
        # connect_robust reconnects, and the publisher opens its channel on the new
        # connection: the failed events go through.

        async def republish() -> None:
            nonlocal failed
            outcomes = await publisher.publish_many(failed)
            failed = [e for e, r in zip(failed, outcomes, strict=True) if r is not None]
            for error in outcomes:
                if error is not None:
                    raise error  # an outage, until the connection is back

        await eventually(republish)
    finally:
        await publisher.aclose()
        await gate.kill()
    # Every event is in the queue, at least once (confirms lost in the cut are republished).
    ids: set[str] = set()
    while (message := await queue.get(fail=False, timeout=5)) is not None:
        await message.ack()
        ids.add(message.message_id)
    assert ids == {e.id for e in wave}
