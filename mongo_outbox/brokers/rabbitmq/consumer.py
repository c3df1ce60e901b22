"""Run a guarded handler on RabbitMQ messages through aio-pika, and settle them.

RabbitMQ has no delayed negative acknowledgement. ``consume_rabbitmq`` sends a message to retry
through a retry queue (``_retry_queues``): a confirmed copy waits out the delay in the broker,
and the original is acknowledged, so it holds no prefetch slot and its delay survives a crash of
the consumer. Where there are no retry queues (``handle_rabbitmq_message``, ``retry_queues=False``,
or a copy the broker did not take) the message is held by its task for the delay, then requeued.
Ordered mode always holds it: a copy going round a retry queue would come back behind later
messages of its aggregate.

A quorum queue counts deliveries in the ``x-delivery-count`` header and drops (or dead-letters
to its DLX) a message delivered more often than its ``x-delivery-limit``: the delivery whose
count reaches the limit is the last, and a failure there is dead-lettered by the guard. A copy
through a retry queue is a new message whose count starts again; the inbox's attempt records
(``max_attempts``) bound its retries.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from mongo_outbox.brokers._consuming import (
    Dispatcher,
    Rejected,
    being_cancelled,
    check_source,
    delivery_limit_of,
    ready,
    settle,
    stopped_within,
)
from mongo_outbox.brokers.rabbitmq._confirms import server_major
from mongo_outbox.brokers.rabbitmq._retry_queues import RetryQueues
from mongo_outbox.errors import describe
from mongo_outbox.inbox import Guarded, Outcome

try:
    import aiormq.exceptions
    from aio_pika.abc import AbstractIncomingMessage, AbstractQueue
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the RabbitMQ consumer needs the rabbitmq extra: pip install 'mongo-outbox[rabbitmq]'"
    ) from error

log = logging.getLogger(__name__)

# RabbitMQ 4.0 gave quorum queues a delivery limit of 20 unless the queue or a policy sets one.
_RABBITMQ_4_QUORUM_LIMIT = 20


class _Delivery:
    def __init__(
        self,
        message: AbstractIncomingMessage,
        delivery_limit: int | None,
        retries: RetryQueues | None = None,
    ) -> None:
        self.message = message
        self.retries = retries
        self.message_id: object = message.message_id
        self.body = message.body
        self.headers: Mapping[str, Any] = message.headers or {}
        self.content_type = message.content_type  # a CloudEvent's mode (brokers._consuming)
        self.percent_encoded = False  # knative's RabbitMQ binding: ce- values as they are
        # A first delivery carries no count: 0 (with a limit of 0 it is the last).
        delivered = self.headers.get("x-delivery-count", 0)
        self.last = (
            delivery_limit is not None
            and isinstance(delivered, int)
            and delivered >= delivery_limit
        )

    async def ack(self) -> None:
        await self.message.ack()

    async def reject(self) -> None:
        await self.message.reject(requeue=False)

    async def retry_after(self, delay: float, stop: asyncio.Event) -> None:
        if self.retries is not None:
            try:
                await self.retries.send(self.message, delay)
            except Exception as error:  # noqa: BLE001 - held in the process instead
                log.warning(
                    "could not send message %s to a retry queue, holding it for %.1fs: %s",
                    self.message_id,
                    delay,
                    describe(error),
                )
            else:
                # Only now: until the copy is confirmed, the original is the message.
                await self.message.ack()
                return
        await stopped_within(stop, delay)
        await self.message.nack(requeue=True)

    async def give_back(self) -> None:
        await self.message.nack(requeue=True)

    def messaging(self) -> dict[str, str]:
        return {
            "messaging.system": "rabbitmq",
            "messaging.destination.name": self.message.exchange or "",
            "messaging.rabbitmq.destination.routing_key": self.message.routing_key or "",
        }


async def handle_rabbitmq_message(
    message: AbstractIncomingMessage,
    guarded: Guarded,
    *,
    source: str | None = None,
    rejected: Rejected | None = None,
    stop: asyncio.Event | None = None,
    delivery_limit: int | None = None,
) -> Outcome | None:
    """Handle one aio-pika message and settle it with the broker. Returns the outcome, or
    ``None`` for a message rejected before it reached the handler.

    A retry is held for its delay, then requeued; setting ``stop`` requeues it at once.
    ``delivery_limit`` is the queue's ``x-delivery-limit`` (quorum queues): on the last
    delivery a failure is dead-lettered, and a retry that is not the message's fault (another
    consumer holds it, MongoDB is unreachable) is done in the process.
    """
    check_source(source, "handle_rabbitmq_message.source")
    limit = delivery_limit_of(delivery_limit, "handle_rabbitmq_message.delivery_limit")
    return await settle(
        _Delivery(message, limit),
        guarded,
        source=source,
        rejected=rejected,
        stop=stop or asyncio.Event(),
    )


async def consume_rabbitmq(
    queue: AbstractQueue,
    guarded: Guarded,
    *,
    ordered: bool = False,
    source: str | None = None,
    rejected: Rejected | None = None,
    stop: asyncio.Event | None = None,
    delivery_limit: int | None = None,
    retry_queues: bool = True,
) -> None:
    """Consume ``queue`` until ``stop`` is set or the task is cancelled.

    Messages are handled concurrently, up to the channel's prefetch count. A message to retry
    goes to a retry queue, ``<queue>.retry.<ms>``, declared here (see docs/inbox.md for the
    topology; a queue of that name with other arguments raises ``ConfigurationError``); it holds
    no prefetch slot while it waits, and the wait survives a crash. ``retry_queues=False``
    holds it in the process for the delay instead, then requeues it.

    ``ordered=True`` handles the messages of one aggregate one at a time, in the order they
    arrived, and retries in the process so that none overtakes a message being retried.
    ``delivery_limit`` defaults to the ``x-delivery-limit`` the queue was declared with (a
    quorum queue declared without one has RabbitMQ 4's default of 20); pass it when a policy
    sets it. On stop, handlers that are running finish and settle; messages held for a retry or
    waiting their turn are requeued at once.
    """
    check_source(source, "consume_rabbitmq.source")
    limit = delivery_limit_of(delivery_limit, "consume_rabbitmq.delivery_limit")
    await ready(guarded)
    if limit is None:
        limit = await _declared_limit(queue)
    retries: RetryQueues | None = None
    if retry_queues and not ordered:  # ordered mode retries in the process: no retry path
        retries = RetryQueues(queue, guarded.backoff)
        await retries.declare()
    stop = stop or asyncio.Event()
    dispatcher = Dispatcher(guarded, source=source, rejected=rejected, ordered=ordered)

    async def on_message(message: AbstractIncomingMessage) -> None:
        dispatcher.dispatch(_Delivery(message, limit, retries))

    try:
        tag = await queue.consume(on_message)
        try:
            await stop.wait()
        finally:
            cancelled = being_cancelled()
            try:
                await _cancel(queue, tag)
            finally:
                await dispatcher.drain(cancelled=cancelled)
    finally:
        if retries is not None:
            await retries.close()


_CANCEL_WAIT = 5.0
"""Seconds a stop waits for RabbitMQ to take the consumer's cancel."""


async def _cancel(queue: AbstractQueue, tag: str) -> None:
    # With the connection down, a robust channel waits for it to come back: a stop would wait
    # as long. A consumer whose connection is gone gets nothing more; the drain settles what
    # it holds (what cannot be acked now comes back to another consumer).
    if getattr(queue.channel, "is_closed", False):
        log.warning("consumer %s of queue %s: its channel is closed: stopping", tag, queue.name)
        return
    try:
        await asyncio.wait_for(queue.cancel(tag), _CANCEL_WAIT)
    except (asyncio.TimeoutError, aiormq.exceptions.AMQPError, ConnectionError) as error:
        log.warning(
            "consumer %s of queue %s: no cancel within %gs (%s): stopping all the same",
            tag,
            queue.name,
            _CANCEL_WAIT,
            describe(error),
        )


async def _declared_limit(queue: AbstractQueue) -> int | None:
    arguments = queue.arguments or {}
    declared = arguments.get("x-delivery-limit")
    if isinstance(declared, int) and not isinstance(declared, bool):
        return declared
    if arguments.get("x-queue-type") != "quorum":
        return None  # classic queues and streams have no delivery limit
    channel = await queue.channel.get_underlay_channel()
    major = server_major(channel.connection)
    return _RABBITMQ_4_QUORUM_LIMIT if major is not None and major >= 4 else None
