"""RabbitMQPublisher while the broker blocks its connection (``connection.blocked``: a memory
or disk alarm) or reads slowly, through a gate in front of the real RabbitMQ that does what the
broker does (``BlockingGate``): nothing is written while the broker says it blocks, nor beyond
``UNCONFIRMED_BYTES`` unconfirmed, so retries made meanwhile do not pile up in the socket and
arrive once each when the broker reads again; the failures say why."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mongo_outbox import BrokerUnavailableError
from mongo_outbox.brokers.rabbitmq._confirms import UNCONFIRMED_BYTES
from mongo_outbox.publishers import RabbitMQPublisher
from tests.support.brokers import BlockingGate
from tests.support.messages import bind_queue, event
from tests.support.servers import RABBITMQ_URL
from tests.support.waiting import eventually, until

RETRIES = 3  # the relay's retries while the broker blocks


@pytest.fixture
async def gate() -> AsyncIterator[BlockingGate]:
    gate = BlockingGate()
    await gate.start()
    yield gate
    gate.unblock()
    await gate.kill()


async def copies(queue: Any) -> Counter[str]:
    """How many copies of each message ``queue`` holds, read by a consumer of the test's own."""
    counted: Counter[str] = Counter()
    while (message := await queue.get(fail=False, timeout=5)) is not None:
        await message.ack()
        counted[message.message_id] += 1
    return counted


def failures(results: list[BaseException | None]) -> set[str]:
    assert all(isinstance(r, BrokerUnavailableError) for r in results), results
    return {str(r).split(": ", 1)[1] for r in results}


async def test_nothing_is_written_while_the_broker_blocks_and_each_event_arrives_once_more_at_most(
    channel: Any, unique: str, gate: BlockingGate, caplog: pytest.LogCaptureFixture
) -> None:
    queue = await bind_queue(channel, unique)
    publisher = await RabbitMQPublisher.connect(gate.url, exchange=unique, timeout=1)
    wave = [event(aggregate_id=n) for n in range(200)]
    try:
        assert await publisher.publish_many([event()]) == [None]  # the channel is open
        # The alarm: the broker reads nothing more, and says so a moment later. A wave written
        # meanwhile waits in the socket for it.
        gate.stop_reading()
        assert failures(await publisher.publish_many(wave)) == {"no confirm within 1s"}
        gate.tell_blocked()
        await until(lambda: "was blocked" in caplog.text)  # aiormq read connection.blocked
        for _ in range(RETRIES):
            reasons = failures(await publisher.publish_many(wave))
            assert reasons == {
                "nothing written within 1s: blocked by the broker (connection.blocked: a "
                "memory or disk alarm)"
            }
        gate.unblock()
        results = await eventually(lambda: publisher.publish_many(wave))
        assert results == [None] * len(wave)
    finally:
        await publisher.aclose()
    counted = await copies(queue)
    # The copy written before the broker said it blocked, and the retry after: never one per
    # retry made while it blocked.
    assert {counted[e.id] for e in wave} == {2}


async def test_a_broker_that_reads_slowly_gets_no_more_than_the_bound_unconfirmed(
    channel: Any, unique: str, gate: BlockingGate
) -> None:
    queue = await bind_queue(channel, unique)
    publisher = await RabbitMQPublisher.connect(gate.url, exchange=unique, timeout=1)
    large = {"data": "x" * (UNCONFIRMED_BYTES // 6)}
    first = [event(aggregate_id=n, payload=large) for n in range(4)]
    second = [event(aggregate_id=n, payload=large) for n in range(4, 8)]
    try:
        assert await publisher.publish_many([event()]) == [None]  # the channel is open
        gate.stop_reading()  # a slow disk: no alarm, the broker just reads nothing for now
        assert failures(await publisher.publish_many(first)) == {"no confirm within 1s"}
        for _ in range(RETRIES):
            [reason] = failures(await publisher.publish_many(second))
            assert reason.startswith("nothing written within 1s: ")
            assert "bytes written are not confirmed yet" in reason
        gate.unblock()
        assert await eventually(lambda: publisher.publish_many(second)) == [None] * 4
    finally:
        await publisher.aclose()
    counted = await copies(queue)
    assert {counted[e.id] for e in first + second} == {1}


async def test_a_wave_over_the_bound_goes_when_nothing_else_is_unconfirmed(
    channel: Any, unique: str
) -> None:
    queue = await bind_queue(channel, unique)
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique, timeout=10)
    large = {"data": "x" * (UNCONFIRMED_BYTES // 2)}
    wave = [event(aggregate_id=n, payload=large) for n in range(3)]
    try:
        assert await publisher.publish_many(wave) == [None] * 3
    finally:
        await publisher.aclose()
    assert set(await copies(queue)) == {e.id for e in wave}


async def test_a_connection_dropped_while_the_broker_blocks_it_comes_back_and_publishing_resumes(
    channel: Any, unique: str, gate: BlockingGate, caplog: pytest.LogCaptureFixture
) -> None:
    # A broker restarted to clear its alarm drops every connection it blocks. aio-pika's robust
    # channel of the exchange reopens on the connection it lost, through aiormq's ready(),
    # which waits for that connection's connection.unblocked: it used to wait for ever, and the
    # robust connection's next reconnection with it, so nothing was published again.
    queue = await bind_queue(channel, unique)
    publisher = await RabbitMQPublisher.connect(gate.url, exchange=unique, timeout=1)
    sent = [event(), event()]
    try:
        assert await publisher.publish_many([event()]) == [None]  # the channel is open
        gate.tell_blocked()
        await until(lambda: "was blocked" in caplog.text)
        await gate.kill()
        await gate.start()
        await eventually(lambda: publisher.publish(sent[0]))
        await gate.kill()  # and once more, unblocked: the robust connection reconnects again
        await gate.start()
        await eventually(lambda: publisher.publish(sent[1]))
    finally:
        await publisher.aclose()
    counted = await copies(queue)
    assert [counted[e.id] for e in sent] == [1, 1]
