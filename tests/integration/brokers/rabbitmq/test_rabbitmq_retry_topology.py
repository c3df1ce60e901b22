"""The topology ``consume_rabbitmq`` declares and expects, against the real RabbitMQ: a retry
queue the broker has with other arguments, a name too long, a missing work queue are each a
ConfigurationError that leaves the caller's channel open; consumers that got one queue in
different ways declare the same retry queues."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mongo_outbox import Backoff, ConfigurationError, Event, Inbox, inbox_guard
from mongo_outbox.consumers import consume_rabbitmq
from tests.support.queues import ready_count

MISMATCHES = {
    "another TTL": {"durable": True, "arguments": {"x-message-ttl": 999}},
    "not durable": {
        "durable": False,
        "arguments": {
            "x-message-ttl": 3000,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "<work queue>",
        },
    },
    "another work queue": {
        "durable": True,
        "arguments": {
            "x-message-ttl": 3000,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "elsewhere",
        },
    },
}


@pytest.mark.parametrize("mismatch", list(MISMATCHES))
async def test_a_retry_queue_declared_with_other_arguments_is_a_configuration_error(
    db: Any, amqp_connection: Any, unique: str, mismatch: str
) -> None:
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique, durable=True)
    existing = dict(MISMATCHES[mismatch])
    arguments = {
        key: unique if value == "<work queue>" else value
        for key, value in existing["arguments"].items()  # type: ignore[attr-defined]
    }
    other = await amqp_connection.channel()
    await other.declare_queue(
        f"{unique}.retry.3000", durable=existing["durable"], arguments=arguments
    )
    try:

        @inbox_guard(Inbox(db, consumer="billing"), backoff=Backoff(initial=3, maximum=3))
        async def bill(event: Event, session: Any) -> None:
            pass

        with pytest.raises(ConfigurationError) as raised:
            await consume_rabbitmq(queue, bill, stop=asyncio.Event())
        assert f"the retry queue '{unique}.retry.3000' exists with other arguments" in str(
            raised.value
        )
        assert "PRECONDITION_FAILED" in str(raised.value)
        assert raised.value.setting == "consume_rabbitmq.queue"
        # It was found out on a channel of its own: the caller's channel is still open.
        assert not channel.is_closed
        assert await queue.get(fail=False, timeout=1) is None
    finally:
        await other.queue_delete(f"{unique}.retry.3000")
        await queue.delete(if_unused=False, if_empty=False)
        await channel.close()
        await other.close()


async def test_a_work_queue_name_too_long_for_its_retry_queues_is_a_configuration_error(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique + "x" * (250 - len(unique)), exclusive=True)

    @inbox_guard(Inbox(db, consumer="billing"))
    async def bill(event: Event, session: Any) -> None:
        pass

    with pytest.raises(ConfigurationError, match="longer than 255 bytes"):
        await consume_rabbitmq(queue, bill, stop=asyncio.Event())
    # Without retry queues the same queue is consumed, retries held in the process.
    stop = asyncio.Event()
    stop.set()
    await consume_rabbitmq(queue, bill, stop=stop, retry_queues=False)
    await channel.close()


async def test_consumers_of_one_queue_got_either_way_declare_the_same_retry_queues(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    """One process declares the quorum queue with its arguments, another gets it by name (its
    queue object knows no arguments): both start, on the same classic retry queues."""
    channel = await amqp_connection.channel()
    declared = await channel.declare_queue(
        unique, durable=True, arguments={"x-queue-type": "quorum"}
    )
    got = await (await amqp_connection.channel()).get_queue(unique)
    backoff = Backoff(initial=3, maximum=3)

    @inbox_guard(Inbox(db, consumer="billing"), backoff=backoff)
    async def bill(event: Event, session: Any) -> None:
        pass

    stopped = asyncio.Event()
    stopped.set()  # declare, consume, and stop at once
    try:
        for queue in (declared, got, declared):
            await consume_rabbitmq(queue, bill, stop=stopped)
        assert await ready_count(channel, f"{unique}.retry.3000") == 0  # it exists
    finally:
        await channel.queue_delete(f"{unique}.retry.3000")
        await declared.delete(if_unused=False, if_empty=False)
        await channel.close()


async def test_a_work_queue_that_does_not_exist_is_a_configuration_error(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    """Retry copies would be dead-lettered to nowhere: refused before anything is sent."""
    channel = await amqp_connection.channel()
    queue = await channel.get_queue(unique, ensure=False)

    @inbox_guard(Inbox(db, consumer="billing"))
    async def bill(event: Event, session: Any) -> None:
        pass

    with pytest.raises(ConfigurationError, match=f"the work queue '{unique}' does not exist"):
        await consume_rabbitmq(queue, bill, stop=asyncio.Event())
    assert not channel.is_closed
    await channel.close()
