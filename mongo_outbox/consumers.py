"""Run an ``inbox_guard``-ed handler on RabbitMQ (aio-pika) and NATS JetStream messages.

Outcome to broker action:

==============  =====================================  ==================================
outcome         RabbitMQ                               NATS JetStream
==============  =====================================  ==================================
handled         ack                                    ack
duplicate       ack                                    ack
retry           nack(requeue) after the backoff delay  nak(delay=backoff delay)
dead-lettered   ack (the dead letter has it)           ack (the dead letter has it)
no message id   reject, no requeue (to the DLX, if     term
or not an       the queue has one), ``rejected``
Event           callback                               ``rejected`` callback
==============  =====================================  ==================================

RabbitMQ has no delayed negative acknowledgement, so a message to retry is held by its task for
the delay, then requeued; it occupies one prefetch slot meanwhile, and other messages go on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from mongo_outbox.errors import InvalidEventError, MessageIdentityError
from mongo_outbox.events import Event
from mongo_outbox.inbox import Guarded, Outcome

log = logging.getLogger(__name__)

Rejected = Callable[[bytes, str], Awaitable[None]]
"""``rejected(body, reason)``: told of a message that could not even be identified or decoded."""


async def handle_rabbitmq_message(
    message: Any, guarded: Guarded, *, source: str | None = None, rejected: Rejected | None = None
) -> Outcome | None:
    """Handle one aio-pika ``IncomingMessage`` and settle it with the broker. Returns the
    outcome, or ``None`` for a message rejected before it reached the handler."""
    event = _decode(message.message_id, message.body)
    if isinstance(event, str):
        log.error("rejecting RabbitMQ message: %s", event)
        if rejected is not None:
            await rejected(message.body, event)
        await message.reject(requeue=False)
        return None
    result = await guarded.handle(event, message_id=message.message_id, source=source)
    if result.outcome is Outcome.RETRY:
        await asyncio.sleep(result.delay)
        await message.nack(requeue=True)
    else:
        await message.ack()
    return result.outcome


async def handle_nats_message(
    message: Any, guarded: Guarded, *, source: str | None = None, rejected: Rejected | None = None
) -> Outcome | None:
    """Handle one JetStream message (from a pull or push subscription) and settle it."""
    message_id = (message.headers or {}).get("Nats-Msg-Id")
    event = _decode(message_id, message.data)
    if isinstance(event, str):
        log.error("terminating NATS message: %s", event)
        if rejected is not None:
            await rejected(message.data, event)
        await message.term()
        return None
    result = await guarded.handle(event, message_id=message_id, source=source)
    if result.outcome is Outcome.RETRY:
        await message.nak(delay=result.delay)
    else:
        await message.ack()
    return result.outcome


async def consume_rabbitmq(
    queue: Any,
    guarded: Guarded,
    *,
    source: str | None = None,
    rejected: Rejected | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Consume ``queue`` (an aio-pika queue) until ``stop`` is set or the task is cancelled.
    Messages are handled concurrently, up to the channel's prefetch count."""
    stop = stop or asyncio.Event()
    tasks: set[asyncio.Task[Any]] = set()

    async def on_message(message: Any) -> None:
        task = asyncio.create_task(
            handle_rabbitmq_message(message, guarded, source=source, rejected=rejected)
        )
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    tag = await queue.consume(on_message)
    try:
        await stop.wait()
    finally:
        await queue.cancel(tag)
        # Messages being handled finish and settle; unsettled ones return to the queue.
        await asyncio.gather(*tasks)


async def consume_nats(
    js: Any,
    subject: str,
    durable: str,
    guarded: Guarded,
    *,
    stream: str | None = None,
    batch: int = 32,
    source: str | None = None,
    rejected: Rejected | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Pull from a durable JetStream consumer until ``stop`` is set or the task is cancelled."""
    import nats.errors

    stop = stop or asyncio.Event()
    subscription = await js.pull_subscribe(subject, durable=durable, stream=stream)
    try:
        while not stop.is_set():
            try:
                messages = await subscription.fetch(batch, timeout=0.5)
            except nats.errors.TimeoutError:
                continue
            await asyncio.gather(
                *(
                    handle_nats_message(m, guarded, source=source, rejected=rejected)
                    for m in messages
                )
            )
    finally:
        await subscription.unsubscribe()


def _decode(message_id: str | None, body: bytes) -> Event | str:
    """The message's Event, or why it cannot be handled at all."""
    if not message_id:
        return str(MessageIdentityError("message has no id to deduplicate on; not processed"))
    try:
        return Event.from_json(body)
    except InvalidEventError as error:
        return f"message {message_id} is not an Event: {error}"
