"""What FastStream's Redis stream subscriber does with an entry, measured against the real Redis
(docs/redis.md says what follows from it): when it acknowledges, what a failing or killed
handler leaves behind, and what a duplicate XADD does. These tests pin FastStream's behaviour:
one that fails means FastStream changed, and docs/redis.md must be revisited."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("faststream.redis")
from faststream import AckPolicy
from faststream.redis import RedisBroker, StreamSub
from redis.asyncio import Redis

from tests.support.servers import REDIS_URL
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture
async def redis(unique: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(REDIS_URL)
    yield client
    await client.delete(unique)
    await client.aclose()


async def pending(redis: Redis, stream: str, group: str) -> int:
    return int((await redis.xpending(stream, group))["pending"])


def none_pending(redis: Redis, stream: str, group: str) -> Any:
    async def check() -> bool:
        return await pending(redis, stream, group) == 0

    return check


async def started(broker: RedisBroker) -> RedisBroker:
    await broker.start()
    return broker


async def test_faststream_acks_a_stream_entry_after_its_handler_returns(
    redis: Redis, unique: str
) -> None:
    broker = RedisBroker(REDIS_URL)
    during: list[int] = []

    @broker.subscriber(stream=StreamSub(unique, group="g", consumer="c1"))
    async def handle(body: str) -> None:
        during.append(await pending(redis, unique, "g"))

    await broker.start()
    try:
        await broker.publish("one", stream=unique)
        await until(lambda: bool(during))
        await until(none_pending(redis, unique, "g"))
    finally:
        await broker.stop()
    assert during == [1]  # pending while the handler ran: XACK comes after it


async def test_faststream_leaves_a_failed_entry_pending_and_never_delivers_it_again(
    redis: Redis, unique: str
) -> None:
    broker = RedisBroker(REDIS_URL)
    calls: list[str] = []

    @broker.subscriber(stream=StreamSub(unique, group="g", consumer="c1"))
    async def handle(body: str) -> None:
        calls.append(body)
        if body == "bad":
            raise RuntimeError("handler failed")

    await broker.start()
    try:
        await broker.publish("bad", stream=unique)
        await broker.publish("good", stream=unique)
        await until(lambda: calls == ["bad", "good"])
        await asyncio.sleep(1.0)  # a redelivery would have come by now
    finally:
        await broker.stop()
    # The default policy (REJECT_ON_ERROR) "rejects" a stream entry by not acknowledging it:
    # it stays in the group's pending list, and XREADGROUP ">" never returns it again.
    assert calls == ["bad", "good"]
    assert await pending(redis, unique, "g") == 1


async def test_faststream_nack_on_error_does_not_redeliver_either(
    redis: Redis, unique: str
) -> None:
    broker = RedisBroker(REDIS_URL)
    calls: list[str] = []

    @broker.subscriber(
        stream=StreamSub(unique, group="g", consumer="c1"), ack_policy=AckPolicy.NACK_ON_ERROR
    )
    async def handle(body: str) -> None:
        calls.append(body)
        raise RuntimeError("handler failed")

    await broker.start()
    try:
        await broker.publish("bad", stream=unique)
        await until(lambda: calls == ["bad"])
        await asyncio.sleep(1.0)
    finally:
        await broker.stop()
    assert calls == ["bad"]
    assert await pending(redis, unique, "g") == 1


async def test_faststream_delivers_a_duplicate_xadd_twice(redis: Redis, unique: str) -> None:
    broker = RedisBroker(REDIS_URL)
    calls: list[str] = []

    @broker.subscriber(stream=StreamSub(unique, group="g", consumer="c1"))
    async def handle(body: str) -> None:
        calls.append(body)

    await broker.start()
    try:
        # The same event published twice (a relay that crashed before recording the first):
        # Redis gives each XADD an entry of its own, and FastStream has nothing to dedupe on.
        await broker.publish("event-1", stream=unique)
        await broker.publish("event-1", stream=unique)
        await until(lambda: len(calls) == 2)
    finally:
        await broker.stop()
    assert calls == ["event-1", "event-1"]


@pytest.mark.crash
async def test_faststream_entry_of_a_killed_handler_is_reclaimed_only_by_a_claiming_subscriber(
    redis: Redis, unique: str
) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.crash.faststream_redis_process",
        REDIS_URL,
        unique,
        "g",
        "doomed",
        cwd=ROOT,
    )
    await until(lambda: redis.exists(unique), timeout=30)
    publisher = await started(RedisBroker(REDIS_URL))
    try:
        await publisher.publish("event-1", stream=unique)
    finally:
        await publisher.stop()
    assert await asyncio.wait_for(process.wait(), 30) == -9  # SIGKILLed in the handler
    assert await pending(redis, unique, "g") == 1

    # Another consumer of the group, reading new entries only, never sees it.
    calls: list[str] = []
    plain = RedisBroker(REDIS_URL)

    @plain.subscriber(stream=StreamSub(unique, group="g", consumer="plain"))
    async def fresh(body: str) -> None:
        calls.append(f"plain:{body}")

    # A subscriber with min_idle_time reads through XAUTOCLAIM only (never new entries), so
    # recovery takes a second subscriber of its own.
    claiming = RedisBroker(REDIS_URL)

    @claiming.subscriber(stream=StreamSub(unique, group="g", consumer="claimer", min_idle_time=500))
    async def reclaimed(body: str) -> None:
        calls.append(f"claimer:{body}")

    await plain.start()
    try:
        await asyncio.sleep(1.0)
        assert calls == []
        await claiming.start()
        try:
            await until(lambda: bool(calls), timeout=30)
            await until(none_pending(redis, unique, "g"))
        finally:
            await claiming.stop()
    finally:
        await plain.stop()
    assert calls == ["claimer:event-1"]


async def test_faststream_reclaims_a_failing_entry_without_limit_or_dead_letter(
    redis: Redis, unique: str
) -> None:
    broker = RedisBroker(REDIS_URL)
    calls: list[Any] = []

    @broker.subscriber(stream=StreamSub(unique, group="g", consumer="c1"))
    async def first(body: str) -> None:
        calls.append(body)
        raise RuntimeError("poison")

    @broker.subscriber(stream=StreamSub(unique, group="g", consumer="c2", min_idle_time=100))
    async def again(body: str) -> None:
        calls.append(body)
        raise RuntimeError("poison")

    await broker.start()
    try:
        await broker.publish("poison", stream=unique)
        await until(lambda: len(calls) >= 6, timeout=30)
    finally:
        await broker.stop()
    # Delivered again and again (no delivery limit, nothing dead-lettered), still pending.
    assert set(calls) == {"poison"}
    assert await pending(redis, unique, "g") == 1
    assert int((await redis.xpending_range(unique, "g", "-", "+", 1))[0]["times_delivered"]) >= 6


async def test_inbox_handler_on_a_redis_subscriber_says_to_use_consume_redis(
    db: Any, redis: Redis, unique: str, capfd: pytest.CaptureFixture[str]
) -> None:
    # It said "a builtins.dict message (a batch subscriber delivers a list ...)": this is no
    # batch subscriber, and what guards a Redis stream is consume_redis.
    from mongo_outbox import Event, Inbox
    from mongo_outbox.faststream import inbox_handler
    from mongo_outbox.publishers import FastStreamPublisher

    broker = RedisBroker(REDIS_URL)
    ran: list[str] = []

    @broker.subscriber(stream=StreamSub(unique, group="g", consumer="c1"))
    @inbox_handler(Inbox(db, consumer="billing"))
    async def bill(event: Event, session: Any) -> None:
        ran.append(event.id)

    printed: list[str] = []

    def said() -> bool:  # FastStream's own logger prints it (stdout): it does not propagate
        printed.append("".join(capfd.readouterr()))
        return "consume_redis guards Redis streams" in "".join(printed)

    await broker.start()
    try:
        await FastStreamPublisher(broker, unique).publish(Event(type="e"))
        await until(said, timeout=15)
    finally:
        await broker.stop()
    assert ran == []
