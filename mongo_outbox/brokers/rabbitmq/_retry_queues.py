"""Retry queues: RabbitMQ holds a message for its retry delay, not the consumer's process.

RabbitMQ has no delayed negative acknowledgement, and the delayed-message exchange is a plugin
that may not be there. What every broker has is a queue with a message TTL that dead-letters
expired messages: ``consume_rabbitmq`` declares, next to the work queue ``Q``, one such queue per
delay bucket::

    Q.retry.<ms>   x-message-ttl: <ms>
                   x-dead-letter-exchange: ""        (the default exchange)
                   x-dead-letter-routing-key: Q      (so back to the work queue)

No consumer reads a retry queue: a message waits there ``<ms>`` milliseconds and goes back to
``Q``. The buckets are a small fixed set drawn from the guard's ``Backoff`` (its ceilings
``initial * factor ** k``, then ``maximum``; at most ``MAX_BUCKETS``), and a delay goes to the
smallest bucket that is not shorter, so that the number of queues stays small. One TTL per queue
keeps expiry in arrival order: RabbitMQ expires messages only at a queue's head.

To retry a delivery, a copy (same body, message id and properties, an ``outbox-retries`` header
counting its trips) is published to its bucket with publisher confirms, and only once the broker
confirmed it is the original acknowledged. A crash between the two leaves both the original
(redelivered) and the copy (after its delay): the inbox records make the second a duplicate or
count it as an attempt, so the effect happens once and ``max_attempts`` still ends the retries.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from typing import Any

from mongo_outbox.errors import ConfigurationError
from mongo_outbox.settings import Backoff

try:
    import aiormq
    from aio_pika.abc import AbstractIncomingMessage, AbstractQueue
    from aiormq.abc import AbstractChannel
    from pamqp.commands import Basic
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the RabbitMQ consumer needs the rabbitmq extra: pip install 'mongo-outbox[rabbitmq]'"
    ) from error

log = logging.getLogger(__name__)

MAX_BUCKETS = 16
"""The most retry queues one work queue gets."""

RETRIES_HEADER = "outbox-retries"
"""How many times a message went through a retry queue (informational: the inbox counts
attempts)."""

_MAX_NAME = 255  # bytes in an AMQP 0-9-1 queue name
_CONFIRM_TIMEOUT = 30.0  # seconds the broker may take to confirm a copy
# Headers the broker sets; a copy starts afresh (its deliveries and deaths are its own).
_BROKER_HEADERS = frozenset(
    {
        "x-delivery-count",
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
# Reply codes a queue declaration fails with that are the topology's fault, not the network's.
_ACCESS_REFUSED = 403  # a reserved name ("amq."), or no configure permission
_PRECONDITION_FAILED = 406  # the queue exists with other arguments
_MAX_TTL_MS = 2**32 - 1  # x-message-ttl is an unsigned 32-bit count of milliseconds


def retry_buckets(backoff: Backoff) -> tuple[int, ...]:
    """The retry queues' TTLs, in milliseconds, ascending: the ceilings of ``backoff``'s
    delays, at most ``MAX_BUCKETS`` of them."""
    initial, maximum = float(backoff.initial), float(backoff.maximum)  # type: ignore[arg-type]
    # In whole milliseconds, as x-message-ttl counts; Backoff refuses a zero initial delay.
    first, last = math.ceil(initial * 1000), math.ceil(maximum * 1000)
    factor = float(backoff.factor)
    points = [float(first), float(last)]
    if last > first and factor > 1:
        steps = math.ceil(math.log(last / first, factor))
        if steps + 1 > MAX_BUCKETS:  # a factor close to 1, or a wide range: fewer, wider steps
            steps = MAX_BUCKETS - 1
            factor = (last / first) ** (1 / steps)
        points += [first * factor**k for k in range(1, steps)]
    return tuple(sorted({min(last, math.ceil(point)) for point in points}))


def bucket_for(buckets: tuple[int, ...], delay: float) -> int:
    """The shortest bucket not shorter than ``delay`` seconds, or the longest one."""
    wanted = delay * 1000
    return next((ms for ms in buckets if ms >= wanted), buckets[-1])


def retry_queue_name(work_queue: str, ms: int) -> str:
    # Server-named queues ("amq.gen-...") are unique, but "amq." names are reserved to the broker.
    base = work_queue[4:] if work_queue.startswith("amq.") else work_queue
    return f"{base}.retry.{ms}"


class RetryQueues:
    """The retry queues of one work queue, and a confirming channel to publish copies on."""

    def __init__(self, queue: AbstractQueue, backoff: Backoff) -> None:
        self.queue = queue
        self.buckets = retry_buckets(backoff)
        if self.buckets[-1] > _MAX_TTL_MS:
            # RabbitMQ refuses it (value_too_large), which read as a queue with other arguments.
            raise ConfigurationError(
                f"the guard's Backoff.maximum ({self.buckets[-1] / 1000:g} s) is longer than "
                f"RabbitMQ's longest message TTL ({_MAX_TTL_MS / 1000:g} s, about 49 days)",
                setting="inbox_guard.backoff",
            )
        self.names = {ms: retry_queue_name(queue.name, ms) for ms in self.buckets}
        self._channel: AbstractChannel | None = None
        self._opening = asyncio.Lock()
        # Classic queues whatever the work queue's type: what a queue object says of its type
        # depends on how it was got (get_queue knows no arguments), and two consumers of one
        # queue must declare the same retry queues. Durable, so that a delay survives a broker
        # restart; exclusive like an exclusive work queue, which they would outlive otherwise.
        self.exclusive = bool(queue.exclusive)
        for name in self.names.values():
            if len(name.encode()) > _MAX_NAME:
                raise ConfigurationError(
                    f"the retry queue name {name!r} is longer than {_MAX_NAME} bytes: use a "
                    "shorter work queue name, or consume_rabbitmq(retry_queues=False)",
                    setting="consume_rabbitmq.queue",
                )

    def arguments(self, ms: int) -> dict[str, Any]:
        """What the retry queue of bucket ``ms`` is declared with."""
        return {
            "x-message-ttl": ms,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.queue.name,
        }

    async def declare(self) -> None:
        """Open the publishing channel and declare every bucket's queue (idempotent).

        A queue that exists with other arguments raises ``ConfigurationError``; it is declared
        on this channel of its own, so the broker closing it does not close the consumer's.
        """
        underlay = await self.queue.channel.get_underlay_channel()
        channel = await underlay.connection.channel(publisher_confirms=True)
        try:
            await self._check_work_queue(channel)
            for ms, name in self.names.items():
                await self._declare_one(channel, ms, name)
        except BaseException:
            if not channel.is_closed:
                await channel.close()
            raise
        self._channel = channel

    async def _check_work_queue(self, channel: AbstractChannel) -> None:
        # Expired copies are dead-lettered to it by name: were it missing, the broker would drop
        # them without a word.
        try:
            await channel.queue_declare(self.queue.name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity as error:
            raise ConfigurationError(
                f"the work queue {self.queue.name!r} does not exist: declare it before "
                f"consume_rabbitmq (the broker said {_reply_text(error)})",
                setting="consume_rabbitmq.queue",
            ) from error

    async def _declare_one(self, channel: AbstractChannel, ms: int, name: str) -> None:
        arguments = self.arguments(ms)
        durable = not self.exclusive
        try:
            await channel.queue_declare(
                name, durable=durable, exclusive=self.exclusive, arguments=arguments
            )
        except aiormq.exceptions.ChannelPreconditionFailed as error:
            raise ConfigurationError(
                f"the retry queue {name!r} exists with other arguments than consume_rabbitmq "
                f"declares (durable={durable}, exclusive={self.exclusive}, {arguments}): the "
                f"broker said {_reply_text(error)}. Delete it once it is empty (messages waiting "
                "in it would be lost), or change the declaration that made it differ",
                setting="consume_rabbitmq.queue",
            ) from error
        except aiormq.exceptions.ChannelAccessRefused as error:
            raise ConfigurationError(
                f"the broker refused to declare the retry queue {name!r}: {_reply_text(error)}. "
                "Grant the user configure permission on it, or pass retry_queues=False",
                setting="consume_rabbitmq.queue",
            ) from error

    async def send(self, message: AbstractIncomingMessage, delay: float) -> str:
        """Publish a copy of ``message`` to the bucket for ``delay`` and wait for the broker's
        confirm; the retry queue's name. Raises if the broker did not take it."""
        channel = await self._open()
        ms = bucket_for(self.buckets, delay)
        name = self.names[ms]
        confirm = await channel.basic_publish(
            message.body,
            exchange="",
            routing_key=name,
            properties=copy_properties(message),
            mandatory=True,  # a deleted retry queue returns it, raising PublishError
            timeout=_CONFIRM_TIMEOUT,
        )
        if not isinstance(confirm, Basic.Ack):
            raise aiormq.exceptions.DeliveryError(None, confirm)  # type: ignore[arg-type]
        return name

    async def _open(self) -> AbstractChannel:
        async with self._opening:  # one new channel, however many retries find it closed
            if self._channel is None or self._channel.is_closed:
                # The connection came back (a robust connection reconnects): a new channel,
                # and the queues again in case they were exclusive to the old connection.
                await self.declare()
            assert self._channel is not None
            return self._channel

    async def close(self) -> None:
        if self._channel is not None and not self._channel.is_closed:
            await self._channel.close()
        self._channel = None


def copy_properties(message: AbstractIncomingMessage) -> Basic.Properties:
    """The original's properties, but the broker's own headers and the per-message TTL (the
    bucket's TTL is the delay now). ``user_id`` is left out: the broker checks it against the
    consumer's user, which need not be the publisher's."""
    headers: dict[str, Any] = {
        key: value for key, value in (message.headers or {}).items() if key not in _BROKER_HEADERS
    }
    headers[RETRIES_HEADER] = retries_of(message.headers or {}) + 1
    return Basic.Properties(
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        headers=headers,
        delivery_mode=2,  # persistent: the delay must survive a broker restart
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        message_id=message.message_id,
        timestamp=message.timestamp,
        message_type=message.type,
        app_id=message.app_id,
    )


def retries_of(headers: Mapping[str, Any]) -> int:
    value = headers.get(RETRIES_HEADER)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _reply_text(error: BaseException) -> str:
    # aiormq's channel errors carry the broker's close frame: its reply text says what differs.
    frame = error.args[0] if error.args else None
    return str(getattr(frame, "reply_text", None) or error)
