"""``mongo-outbox relay``, the real console script in a subprocess, against the test MongoDB and
the real brokers: it publishes live, stops cleanly on SIGTERM or SIGINT, and refuses a bad
configuration in one line before relaying anything."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest

from mongo_outbox import Event, Outbox, PollingRelay
from mongo_outbox.publishers import MemoryPublisher
from tests.support.cli import (
    Service,
    cli,
    environment,
    held,
    lease_of,
    save_orders,
    stream_ids,
    until_active,
)
from tests.support.messages import bind_queue, drain_queue
from tests.support.servers import NATS_URL, RABBITMQ_URL, MongoServer
from tests.support.waiting import until

NATS_PASSWORD = "n4ts-Secret-pw"  # the test NATS server takes any credentials
SECRET_NATS = NATS_URL.replace("nats://", f"nats://relay:{NATS_PASSWORD}@")


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
async def test_the_relay_publishes_live_and_gives_its_lease_up_on_a_signal(
    mongo: MongoServer, db: Any, nats_client: Any, nats_stream: str, stop: signal.Signals
) -> None:
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    await outbox.ensure_indexes()
    before = await save_orders(outbox, db, 2)
    # Configured through the environment twins alone.
    env = environment(
        MONGO_OUTBOX_URI=mongo.uri,
        MONGO_OUTBOX_DB=db.name,
        MONGO_OUTBOX_MODE="embedded",
        MONGO_OUTBOX_COLLECTIONS="orders",
        MONGO_OUTBOX_NAME="orders-relay",
        MONGO_OUTBOX_NATS=SECRET_NATS,
        MONGO_OUTBOX_SUBJECT=f"{nats_stream}.{{type}}",
    )
    relay = await Service("relay", env=env).start()
    try:
        await until_active(db, "orders-relay", relay)
        # Saved while the relay runs: the change stream brings them.
        live = await save_orders(outbox, db, 3, start=2)
        ids = await stream_ids(nats_client, nats_stream, 5)
        ran = await relay.stop(stop, timeout=10)
    finally:
        relay.kill()
    assert sorted(ids) == sorted(e.id for e in before + live)
    assert ran.code == 0, ran.output
    assert not held(await lease_of(db, "orders-relay"))  # given up, not left to run out
    log = ran.err.splitlines()
    assert any(f"{stop.name} received" in line for line in log)
    assert any("starting -> active" in line for line in log)
    assert any("active -> stopped" in line for line in log)
    assert NATS_PASSWORD not in ran.output and "relay:***@" in ran.output


async def test_a_polling_relay_publishes_to_rabbitmq_and_stops_on_sigterm(
    mongo: MongoServer, db: Any, channel: Any, unique: str
) -> None:
    import aio_pika

    outbox = Outbox(db)
    await outbox.ensure_indexes()
    saved = await save_orders(outbox, db, 4)
    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(unique, exclusive=True)
    await queue.bind(exchange, "orders.#")
    relay = await Service(
        "relay",
        "--polling",
        "--interval=0.1",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        f"--rabbitmq={RABBITMQ_URL}",
        f"--exchange={unique}",
        "--routing-key=orders.{type}",
        "--name=poller",
    ).start()
    received: list[str] = []
    try:
        while len(received) < len(saved):
            message = await queue.get(timeout=20, fail=False)
            if message is None:
                await asyncio.sleep(0.05)
                continue
            await message.ack()
            received.append(str(message.message_id))
        ran = await relay.stop(signal.SIGTERM, timeout=10)
    finally:
        relay.kill()
    assert received == [e.id for e in saved]
    assert ran.code == 0, ran.output
    assert "relay poller: starting -> active" in ran.err and "active -> stopped" in ran.err


UNREACHABLE = "mongodb://admin:m0ngo-Secret-pw@127.0.0.1:1/?directConnection=true"
WRONG_LOGIN = RABBITMQ_URL.replace("guest:guest@", "guest:r4bbit-Secret-pw@")
NATS_DOWN = "nats://relay:n4ts-Secret-pw@127.0.0.1:1"
NATS = ["--nats", NATS_URL]

# "{uri}" stands for the test MongoDB, "{login}" for it with credentials it refuses.
BAD = [
    pytest.param([f"--uri={UNREACHABLE}", *NATS], "MongoDB at", id="mongodb-unreachable"),
    pytest.param(["--uri={login}", *NATS], "MongoDB at", id="mongodb-login-refused"),
    pytest.param(["--uri={uri}", "--nats", NATS_DOWN], "NATS at", id="nats-unreachable"),
    pytest.param(["--uri={uri}", "--rabbitmq", WRONG_LOGIN], "RabbitMQ at", id="rabbitmq-login"),
    pytest.param(["--uri={uri}", *NATS, "--subject=x.{{typo}}"], "--subject", id="template"),
    pytest.param(["--uri={uri}", *NATS, "--subject=x.>"], "--subject", id="wildcard"),
    pytest.param(
        ["--uri={uri}", "--rabbitmq", RABBITMQ_URL, "--routing-key={{nope}}"],
        "--routing-key",
        id="routing-key",
    ),
    pytest.param(["--uri={uri}", *NATS, "--claim-lease=0"], "--claim-lease", id="lease"),
    pytest.param(
        ["--uri={uri}", *NATS, "--member-lease=30"], "--partitions", id="member-lease-alone"
    ),
    pytest.param(
        ["--uri={uri}", *NATS, "--partitions=2", "--leader-lease=30"],
        "is --member-lease",
        id="leader-lease-of-a-member",
    ),
    pytest.param(
        ["--uri={uri}", *NATS, "--polling", "--max-wait=1"],
        "--max-wait would be unused: a polling relay (--polling) tunes --interval",
        id="max-wait-of-a-polling-relay",
    ),
    pytest.param(
        ["--uri={uri}", *NATS, "--interval=2"],
        "--interval would be unused: a change-stream relay tunes --max-wait",
        id="interval-of-a-change-stream-relay",
    ),
    pytest.param(
        ["--uri={uri}", *NATS, "--polling", "--leader-lease=30"],
        "holds none",
        id="leader-lease-of-a-polling-relay",
    ),
    pytest.param(
        ["--uri={uri}", *NATS, "--partitions=2", "--member-lease=5"],
        "--member-lease",
        id="member-lease-too-short",
    ),
    pytest.param(["--uri={uri}"], "--nats URL or --rabbitmq URL", id="no-broker"),
    pytest.param(["--uri={uri}", *NATS, "--mode=embedded"], "--collections", id="embedded"),
    pytest.param([*NATS], "--uri", id="no-uri"),
]


@pytest.mark.parametrize(("args", "reason"), BAD)
async def test_a_bad_configuration_exits_non_zero_in_one_line_before_relaying(
    mongo: MongoServer, db: Any, args: list[str], reason: str
) -> None:
    login = mongo.uri.replace("://", "://admin:m0ngo-Secret-pw@", 1)
    args = [a.format(uri=mongo.uri, login=login) if "--uri" in a else a for a in args]
    args = [a.replace("{{", "{").replace("}}", "}") for a in args]
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await save_orders(outbox, db, 1)
    ran = await cli("relay", f"--db={db.name}", "--name=never", *args, timeout=30)
    assert ran.code != 0
    assert ran.out == ""
    [line] = ran.err.splitlines()
    assert line.startswith("mongo-outbox: ") and reason in line
    assert "Secret-pw" not in ran.err
    assert await db.outbox.count_documents({"status": "pending"}) == 1
    assert await lease_of(db, "never") == {}


async def test_two_quick_sigints_say_the_second_one_cancelled_the_relay(
    mongo: MongoServer, db: Any, nats_stream: str
) -> None:
    await Outbox(db).ensure_indexes()
    relay = await Service(
        "relay",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        "--name=twice",
        f"--nats={NATS_URL}",
        f"--subject={nats_stream}.{{type}}",
    ).start()
    try:
        await until_active(db, "twice", relay)
        assert relay.process is not None
        relay.process.send_signal(signal.SIGINT)
        await asyncio.sleep(0.05)  # the gap of a double Ctrl-C
        ran = await relay.stop(signal.SIGINT, timeout=15)
    finally:
        relay.kill()
    assert "did not stop within" not in ran.err, ran.output
    if ran.code != 0:  # the first one may have stopped it already
        assert ran.code == 1, ran.output
        assert "was cancelled: a second signal (SIGINT) came before it stopped" in ran.err


async def exchange_exists(amqp_connection: Any, name: str) -> bool:
    import aiormq

    probe = await amqp_connection.channel()
    try:
        await probe.declare_exchange(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    await probe.close()
    return True


@pytest.mark.parametrize("command", [["relay", "--polling"], ["replay", "--since=1h"]])
async def test_a_named_exchange_that_does_not_exist_is_refused_not_declared(
    mongo: MongoServer, db: Any, amqp_connection: Any, channel: Any, unique: str, command: list[str]
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await save_orders(outbox, db, 1)
    if command[0] == "replay":  # published already, for the replay to find
        assert await PollingRelay(outbox, MemoryPublisher()).drain() == 1
    where = [f"--uri={mongo.uri}", f"--db={db.name}", f"--rabbitmq={RABBITMQ_URL}"]

    ran = await cli(*command, *where, f"--exchange={unique}")

    assert ran.code == 1, ran.output
    assert f"has no exchange '{unique}': a misspelling?" in ran.err
    assert "--declare-exchange" in ran.err and "Traceback" not in ran.err
    assert not await exchange_exists(amqp_connection, unique)


async def test_declare_exchange_declares_a_named_exchange(
    mongo: MongoServer, db: Any, amqp_connection: Any, channel: Any, unique: str
) -> None:
    await Outbox(db).ensure_indexes()
    relay = await Service(
        "relay",
        "--polling",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        f"--rabbitmq={RABBITMQ_URL}",
        f"--exchange={unique}",
        "--declare-exchange",
        "--name=declarer",
    ).start()
    try:

        async def declared() -> bool:
            assert relay.process is not None and relay.process.returncode is None
            return await exchange_exists(amqp_connection, unique)

        await until(declared, timeout=20, every=0.1)
        ran = await relay.stop(signal.SIGTERM, timeout=10)
    finally:
        relay.kill()
    assert ran.code == 0, ran.output


async def test_max_message_size_parks_a_longer_message_before_it_is_sent(
    mongo: MongoServer, db: Any, channel: Any, unique: str
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    short = Event(type="placed", payload={"note": "x"})
    long = Event(type="placed", payload={"note": "x" * 2000})
    for n, event in enumerate((short, long)):
        await outbox.save_with_events(None, db.orders, {"_id": n}, [event])
    queue = await bind_queue(channel, unique)
    where = [f"--uri={mongo.uri}", f"--db={db.name}", f"--rabbitmq={RABBITMQ_URL}"]

    ran = await cli("relay", "--drain", *where, f"--exchange={unique}", "--max-message-size=1000")

    assert ran.code == 1, ran.output  # a drain that parked an event did not do its whole job
    assert ran.out.startswith("published 1 events"), ran.output
    [parked] = await db.outbox.find({"status": "parked"}).to_list(None)
    assert parked["_id"] == long.id and "1000" in parked["last_error"]
    [message] = await drain_queue(queue, 1)
    assert message.message_id == short.id


@pytest.mark.parametrize("drain", [False, True])
@pytest.mark.parametrize("broker", ["rabbitmq", "nats"])
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_while_the_relay_connects_stops_it_cleanly(
    mongo: MongoServer, db: Any, stop: signal.Signals, broker: str, drain: bool
) -> None:
    # A broker that accepts the connection and never answers holds the relay in its start-up,
    # before it relays anything: the window where a signal once killed it with the default
    # action (exit -15, no line said).
    accepted = asyncio.Event()
    sockets: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sockets.append(writer)
        accepted.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    await Outbox(db).ensure_indexes()
    relay = await Service(
        "relay",
        "--polling",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        f"--rabbitmq=amqp://guest:guest@127.0.0.1:{port}/"
        if broker == "rabbitmq"
        else f"--nats=nats://127.0.0.1:{port}",
        "--name=starting",
        *(["--drain"] if drain else []),
    ).start()
    try:
        await asyncio.wait_for(accepted.wait(), 20)
        ran = await relay.stop(stop, timeout=10)
    finally:
        relay.kill()
        for writer in sockets:
            writer.close()
        server.close()
    assert "Traceback" not in ran.err
    if drain:  # a one-off job that did not run has failed
        assert ran.code == 1, ran.output
        assert f"relay starting: {stop.name} received before the drain started" in ran.err
    else:
        assert ran.code == 0, ran.output
        assert f"relay starting: {stop.name} received before it started: stopped" in ran.err


async def test_the_relay_publishes_cloudevents_the_sdk_reads(
    mongo: MongoServer, db: Any, nats_client: Any, nats_stream: str
) -> None:
    from cloudevents.core.bindings import http
    from cloudevents.core.formats.json import JSONFormat

    outbox = Outbox(db)
    await outbox.ensure_indexes()
    event = Event(type="placed", payload={"total": 12})
    await outbox.save_with_events(None, db.orders, {"_id": "o-1"}, [event])
    ran = await cli(
        "relay",
        "--drain",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        f"--nats={NATS_URL}",
        f"--subject={nats_stream}.{{type}}",
        "--cloudevents-source=urn:example:orders",
        "--cloudevents-mode=structured",
    )
    assert ran.code == 0, ran.output
    subscription = await nats_client.jetstream().pull_subscribe(f"{nats_stream}.>", durable="c")
    [message] = await subscription.fetch(1, timeout=5)
    read = http.from_structured(http.HTTPMessage(dict(message.headers), message.data), JSONFormat())
    assert (read.get_id(), read.get_source(), read.get_subject()) == (
        event.id,
        "urn:example:orders",
        "o-1",
    )
    assert read.get_data() == {"total": 12}
