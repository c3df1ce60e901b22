"""Messages for broker tests: a sample event, and reading back what a real NATS stream,
consumer or RabbitMQ queue holds."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aio_pika

from mongo_outbox import Event


def event(**fields: Any) -> Event:
    base: dict[str, Any] = {
        "type": "order.placed",
        "payload": {"total": 12.5, "items": [1, 2], "note": "café"},
        "aggregate_type": "orders",
        "aggregate_id": 7,
        "sequence": 3,
        "headers": {"tenant": "acme", "trace": "t-1"},
        "correlation_id": "corr-1",
    }
    return Event(**(base | fields))


async def read_stream(nats_client: Any, stream: str, count: int) -> list[Any]:
    """Every message in ``stream``, in stream order, which must hold exactly ``count``."""
    js = nats_client.jetstream()
    info = await js.stream_info(stream)
    assert info.state.messages == count
    sub = await js.subscribe(f"{stream}.>", ordered_consumer=True)
    try:
        return [await sub.next_msg(timeout=5) for _ in range(count)]
    finally:
        await sub.unsubscribe()


async def pull(subscription: Any, count: int, within: float) -> list[Any]:
    """``count`` messages from a JetStream pull ``subscription``, fetched until they are all
    there or ``within`` seconds passed: one fetch returns what is due when it asks, and a message
    given back with a delay comes due later."""
    import nats.errors

    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    messages: list[Any] = []
    while len(messages) < count and (left := deadline - loop.time()) > 0:
        with contextlib.suppress(nats.errors.TimeoutError):
            messages += await subscription.fetch(count - len(messages), timeout=left)
    return messages


async def bind_queue(channel: Any, exchange: str, pattern: str = "#") -> Any:
    """An exclusive queue bound to ``exchange`` (declared durable topic if it is not yet)."""
    declared = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(exclusive=True)
    await queue.bind(declared, pattern)
    return queue


async def drain_queue(queue: Any, count: int) -> list[Any]:
    """``count`` messages from ``queue``, acked; and then nothing more is there.

    Every message was confirmed before this runs, and RabbitMQ confirms a routed message
    only once its queue holds it, so ``get`` need not wait."""
    messages = []
    for _ in range(count):
        message = await queue.get(timeout=5)
        await message.ack()
        messages.append(message)
    assert await queue.get(fail=False, timeout=5) is None
    return messages
