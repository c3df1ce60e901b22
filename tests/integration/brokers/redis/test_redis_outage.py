"""RedisStreamsPublisher when Redis goes away, refuses writes, or runs out of memory, against a
redis-server of the test's own: failures that are not the event's raise BrokerUnavailableError
(BrokerFullError for want of memory), and the relays wait through them without parking."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from mongo_outbox import BrokerFullError, BrokerUnavailableError, ConfigurationError, Event
from mongo_outbox.consumers import consume_redis
from mongo_outbox.publishers import RedisStreamsPublisher
from tests.support.billing import (
    concurrency,
    guarded_billing,
    wait_for_invoices,
)
from tests.support.brokers import KillsTheBroker
from tests.support.outage import relay_through_outage
from tests.support.redis_server import HAVE_REDIS_SERVER, RedisServer
from tests.support.waiting import eventually, until

pytestmark = pytest.mark.skipif(not HAVE_REDIS_SERVER, reason="needs the redis-server binary")


@pytest.fixture
async def redis_server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    server = RedisServer(tmp_path)
    await server.start()
    yield server
    if server.process and server.process.returncode is None:
        await server.kill()


async def test_redis_down_is_an_outage_for_publish_and_publish_many_until_it_is_back(
    redis_server: RedisServer,
) -> None:
    publisher = await RedisStreamsPublisher.connect(redis_server.url, stream="s", timeout=1)
    try:
        await publisher.publish(Event(type="before"))
        await redis_server.kill()
        with pytest.raises(BrokerUnavailableError) as raised:
            await publisher.publish(Event(type="during"))
        assert raised.value.destination is None  # the broker, not this event's stream
        results = await publisher.publish_many([Event(type="a"), Event(type="b")])
        assert all(isinstance(r, BrokerUnavailableError) for r in results)
        await redis_server.start()
        after = Event(type="after")
        await eventually(lambda: publisher.publish(after))
    finally:
        await publisher.aclose()
    client = Redis.from_url(redis_server.url)
    types = [fields[b"event-type"] for _, fields in await client.xrange("s")]
    await client.aclose()
    assert types == [b"before", b"after"]  # nothing of the outage was half-written


async def test_redis_out_of_memory_is_broker_full(redis_server: RedisServer) -> None:
    client = Redis.from_url(redis_server.url)
    await client.config_set("maxmemory", "2mb")
    await client.config_set("maxmemory-policy", "noeviction")
    publisher = RedisStreamsPublisher(client, stream="s", maxlen=None)
    big = {"blob": "x" * 50_000}
    try:
        with pytest.raises(BrokerFullError):
            for _ in range(1000):
                await publisher.publish(Event(type="big", payload=big))
        results = await publisher.publish_many([Event(type="big", payload=big)])
        assert isinstance(results[0], BrokerFullError)
    finally:
        await client.aclose()


async def test_a_replica_refusing_writes_is_an_outage(redis_server: RedisServer) -> None:
    client = Redis.from_url(redis_server.url)
    # A replica of nothing that answers: it refuses writes with READONLY.
    await client.replicaof("127.0.0.1", "1")
    try:
        with pytest.raises(BrokerUnavailableError):
            await RedisStreamsPublisher(client, stream="s").publish(Event(type="e"))
    finally:
        await client.replicaof("NO", "ONE")
        await client.aclose()


async def test_connect_error_hides_the_password() -> None:
    with pytest.raises(ConnectionError) as raised:
        await RedisStreamsPublisher.connect("redis://user:secret@127.0.0.1:1/0", timeout=0.5)
    assert "secret" not in str(raised.value) and "***" in str(raised.value)


@pytest.mark.parametrize("relay_kind", ["polling", "change stream"])
async def test_redis_killed_and_restarted_mid_run_parks_nothing_and_each_effect_happens_once(
    db: Any, mongo: Any, redis_server: RedisServer, relay_kind: str
) -> None:
    inner = await RedisStreamsPublisher.connect(redis_server.url, stream="orders", timeout=0.5)
    publisher = KillsTheBroker(inner, redis_server, after=10)
    try:
        saved = await relay_through_outage(db, publisher, relay_kind)
    finally:
        await publisher.aclose()
    client = Redis.from_url(redis_server.url)
    received = [Event.from_json(fields[b"body"]) for _, fields in await client.xrange("orders")]
    # Every event at least once (one whose answer the kill cut off is there twice: the inbox
    # handles it once), and each order's events first seen in their order.
    assert {e.id for e in received} == {e.id for e in saved}
    for order in range(10):
        firsts: list[int] = []
        for event in received:
            if event.aggregate_id == order and event.sequence not in firsts:
                assert event.sequence is not None
                firsts.append(event.sequence)
        assert firsts == [1, 2, 3, 4]
    # And consume_redis turns what the relay delivered, duplicates included, into one effect each.
    stop = asyncio.Event()
    consumer = asyncio.create_task(
        consume_redis(
            client, "orders", "billing", guarded_billing(db), batch=concurrency(mongo), stop=stop
        )
    )
    try:
        counted = await wait_for_invoices(db, len(saved))
    finally:
        stop.set()
        await asyncio.wait_for(consumer, 30)
        await client.aclose()
    assert counted == {e.id: 1 for e in saved}


async def test_a_redis_that_stops_answering_is_an_outage_within_the_timeout(
    redis_server: RedisServer,
) -> None:
    publisher = await RedisStreamsPublisher.connect(redis_server.url, stream="s", timeout=0.5)
    assert redis_server.process is not None
    redis_server.process.send_signal(signal.SIGSTOP)  # alive, connected, silent
    try:
        event = Event(type="e")
        with pytest.raises(BrokerUnavailableError, match="no answer within") as raised:
            await publisher.publish(event)
        assert raised.value.event_id == event.id
        events = [Event(type="a"), Event(type="b")]
        results = await publisher.publish_many(events)
        assert [getattr(r, "event_id", None) for r in results] == [e.id for e in events]
        assert all(isinstance(r, BrokerUnavailableError) for r in results)
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
        await publisher.aclose()


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        ({"maxlen": 0}, "RedisStreamsPublisher.maxlen"),
        ({"maxlen": 10.5}, "RedisStreamsPublisher.maxlen"),
        ({"timeout": 0}, "RedisStreamsPublisher.timeout"),
    ],
)
def test_settings_out_of_range_are_refused(options: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        RedisStreamsPublisher(Redis(), **options)
    assert raised.value.setting == setting


async def test_consume_redis_rides_out_a_redis_restart_and_each_effect_happens_once(
    db: Any, mongo: Any, redis_server: RedisServer
) -> None:
    client = Redis.from_url(redis_server.url, socket_timeout=1, socket_connect_timeout=1)
    events = [Event(type="e", aggregate_type="orders", aggregate_id=n) for n in range(20)]
    publisher = RedisStreamsPublisher(client, stream="orders")
    assert await publisher.publish_many(events[:10]) == [None] * 10
    stop = asyncio.Event()
    consumer = asyncio.create_task(
        consume_redis(
            client,
            "orders",
            "billing",
            guarded_billing(db),
            claim_idle=1,
            batch=concurrency(mongo),
            stop=stop,
        )
    )
    try:
        await until(lambda: invoices_at_least(db, 3), timeout=30)
        await redis_server.kill()  # mid-run: reads, acks and keep-alives fail meanwhile
        await asyncio.sleep(1.5)
        assert not consumer.done()  # it waits for Redis instead of failing
        await redis_server.start()
        await eventually(lambda: publish_all(publisher, events[10:]))
        counted = await wait_for_invoices(db, len(events))
        await until(lambda: nothing_pending(client), timeout=30)
    finally:
        stop.set()
        await asyncio.wait_for(consumer, 30)
        await client.aclose()
    assert counted == {e.id: 1 for e in events}


async def invoices_at_least(db: Any, count: int) -> bool:
    return await db.invoices.count_documents({}) >= count


async def nothing_pending(client: Redis) -> bool:
    return int((await client.xpending("orders", "billing"))["pending"]) == 0


async def publish_all(publisher: RedisStreamsPublisher, events: list[Event]) -> None:
    for result in await publisher.publish_many(events):
        if result is not None:
            raise result


async def test_consume_redis_rides_out_a_failover_s_read_only_replica(
    db: Any, redis_server: RedisServer
) -> None:
    # The server became a replica (a failover, seen from the old master): its writes answer
    # READONLY. The consumer ended with a raw ReadOnlyError; it now waits as for an outage.
    client = Redis.from_url(redis_server.url)
    admin = Redis.from_url(redis_server.url)
    publisher = RedisStreamsPublisher(client, stream="orders")
    events = [Event(type="e", aggregate_type="orders", aggregate_id=n) for n in range(4)]
    stop = asyncio.Event()
    consumer = asyncio.create_task(
        consume_redis(client, "orders", "billing", guarded_billing(db), claim_idle=1, stop=stop)
    )
    try:
        await until(lambda: consumer_group_exists(admin), timeout=10)
        await admin.replicaof("127.0.0.1", "1")  # nothing listens there: read-only for good
        await asyncio.sleep(1.5)
        assert not consumer.done(), consumer
        await admin.replicaof("NO", "ONE")
        await publish_all(publisher, events)
        assert await wait_for_invoices(db, len(events)) == {e.id: 1 for e in events}
    finally:
        stop.set()
        await asyncio.wait_for(consumer, 30)
        await client.aclose()
        await admin.aclose()


async def consumer_group_exists(client: Redis) -> bool:
    return bool(await client.exists("orders"))


async def test_consume_redis_stops_while_redis_does_not_answer(
    db: Any, redis_server: RedisServer
) -> None:
    # A Redis that stopped answering on an open connection, and a client without a socket
    # timeout (redis-py 5 to 7's default): the blocking read waited for ever, and so did stop.
    client = Redis.from_url(redis_server.url, socket_timeout=None)
    stop = asyncio.Event()
    consumer = asyncio.create_task(
        consume_redis(client, "orders", "billing", guarded_billing(db), stop=stop)
    )
    assert redis_server.process is not None
    try:
        await until(lambda: consumer_group_exists(client), timeout=10)
        redis_server.process.send_signal(signal.SIGSTOP)
        stop.set()
        # ANSWER_WAIT (5 s) and the read's block (0.5 s) at most.
        done, _ = await asyncio.wait([consumer], timeout=15)
        assert done, "consume_redis did not stop while Redis did not answer"
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
        await asyncio.gather(consumer, return_exceptions=True)
        await client.aclose()


async def test_a_consumer_allowed_only_the_stream_commands_consumes(
    db: Any, redis_server: RedisServer
) -> None:
    # A least-privilege ACL: the key-type check at start (TYPE, @keyspace) is skipped, not fatal.
    admin = Redis.from_url(redis_server.url)
    await admin.acl_setuser(
        "billing",
        enabled=True,
        passwords=["+secret"],
        keys=["*"],
        commands=["+@stream", "+@connection"],
    )
    client = Redis(port=redis_server.port, username="billing", password="secret")
    event = Event(type="e", aggregate_type="orders", aggregate_id=1)
    stop = asyncio.Event()
    try:
        await publish_all(RedisStreamsPublisher(admin, stream="orders"), [event])
        consumer = asyncio.create_task(
            consume_redis(client, "orders", "billing", guarded_billing(db), stop=stop)
        )
        try:
            assert await wait_for_invoices(db, 1) == {event.id: 1}
            await until(lambda: nothing_pending(admin), timeout=15)
        finally:
            stop.set()
            await asyncio.wait_for(consumer, 30)
    finally:
        await client.aclose()
        await admin.aclose()
