"""Guard a FastStream subscriber with an ``Inbox``, on RabbitMQ and NATS JetStream.

``inbox_handler`` turns an ``async def handler(event, session)`` into the function a FastStream
subscriber decorates. It is a decorator rather than a FastStream middleware because a middleware
sits outside the subscriber's arguments: it could not hand the handler the inbox's MongoDB
session, and FastStream's middleware API changed between 0.5 and 0.6.

FastStream's own ``msg.message_id`` is no identity to deduplicate on: its NATS parser reads
FastStream's ``message_id`` header, not ``Nats-Msg-Id`` (a message published by anything else
gets a fresh random id on every delivery), and its RabbitMQ parser invents a random id when the
producer set none. So the handler reads the raw message, as ``mongo_outbox.consumers`` does:
the ``Nats-Msg-Id`` header on NATS, the AMQP ``message_id`` property on RabbitMQ; a message
without one is rejected (NATS: term; RabbitMQ: reject without requeue, to the queue's
dead-letter exchange if it has one), never handled blindly. Outcomes settle the message as in
``mongo_outbox.brokers._consuming``: handled, duplicate and dead-lettered are acked; a retry is
nak'ed with its delay on NATS; on RabbitMQ (which has no delayed nack) a confirmed copy waits
out the delay in a retry queue next to the subscriber's queue, as with ``consume_rabbitmq``
(``brokers/rabbitmq/_retry_queues.py``), and the original is acked: the wait holds no prefetch slot
and survives a crash. The handler settles the message itself, so FastStream's acknowledgement (any
``ack_policy`` but ``ACK_FIRST``) finds it settled and leaves it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel

from mongo_outbox.brokers._consuming import (
    Rejected,
    check_source,
    delivery_limit_of,
    settle,
    stopped_within,
)
from mongo_outbox.errors import ConfigurationError, InvalidEventError, PoisonMessage, describe
from mongo_outbox.events import Event
from mongo_outbox.inbox import DeadLetter, Guarded, Inbox, Outcome, inbox_guard
from mongo_outbox.settings import Backoff
from mongo_outbox.upcasters import Upcasters, version_of

try:
    from faststream import Context
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "mongo_outbox.faststream needs the faststream extra: pip install 'mongo-outbox[faststream]'"
    ) from error

if TYPE_CHECKING:
    # Where FastStream 0.6 and later keep it (0.5: faststream.broker.message).
    from faststream.message import StreamMessage

__all__ = ["FastStreamHandler", "inbox_handler"]

_log = logging.getLogger(__name__)

_Handler = Callable[..., Awaitable[None]]


class _WorkQueue:
    """What ``RetryQueues`` needs of a work queue (its name, whether it is exclusive, a channel
    of its connection), from FastStream's subscriber and the latest message it delivered."""

    def __init__(self, name: str, exclusive: bool, channel: Any) -> None:
        self.name = name
        self.exclusive = exclusive
        self.current = channel
        self.channel = self  # RetryQueues asks ``queue.channel.get_underlay_channel()``

    async def get_underlay_channel(self) -> Any:
        return self.current


class _Delivery:
    """A FastStream message as ``settle`` sees it: identity, body and headers from the raw
    message, settled through FastStream's message so that FastStream knows it is settled."""

    def __init__(
        self,
        message: StreamMessage[Any],
        delivery_limit: int | None,
        retries: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.message = message
        self.retries = retries
        raw = message.raw_message
        module = type(raw).__module__
        if module.startswith("nats."):
            self.broker = "nats"
            self.headers: Mapping[str, Any] = raw.headers or {}
            self.message_id: object = self.headers.get("Nats-Msg-Id")
            self.body: bytes = raw.data
            delivered = raw.metadata.num_delivered if delivery_limit else None
        elif module.startswith("aio_pika."):
            self.broker = "rabbitmq"
            self.headers = raw.headers or {}
            self.message_id = raw.message_id
            self.body = raw.body
            self.content_type = raw.content_type  # a CloudEvent's mode (brokers._consuming)
            self.percent_encoded = False  # knative's RabbitMQ binding: ce- values as they are
            delivered = self.headers.get("x-delivery-count", 0)  # none on a first delivery
        else:
            # FastStream's Redis subscribers deliver a dict, its batch subscribers a list.
            why = (
                "a Redis subscriber's: consume_redis guards Redis streams (docs/redis.md)"
                if isinstance(raw, dict)
                else "a batch subscriber delivers a list: guard one message at a time"
            )
            raise ConfigurationError(
                f"inbox_handler guards RabbitMQ and NATS JetStream subscribers, not a "
                f"{type(raw).__module__}.{type(raw).__name__} message ({why})",
                setting="inbox_handler",
            )
        self.last = (
            delivery_limit is not None
            and isinstance(delivered, int)
            and not isinstance(delivered, bool)
            and delivered >= delivery_limit
        )

    def messaging(self) -> dict[str, str]:
        # The consumer span's attributes, as mongo_outbox.consumers gives them.
        raw = self.message.raw_message
        if self.broker == "nats":
            return {"messaging.system": "nats", "messaging.destination.name": raw.subject}
        return {
            "messaging.system": "rabbitmq",
            "messaging.destination.name": raw.exchange or "",
            "messaging.rabbitmq.destination.routing_key": raw.routing_key or "",
        }

    async def ack(self) -> None:
        await self.message.ack()

    async def reject(self) -> None:
        await self.message.reject()  # NATS: term; RabbitMQ: reject without requeue

    async def retry_after(self, delay: float, stop: asyncio.Event) -> None:
        if self.broker == "nats":
            await self.message.nack(delay=delay)  # type: ignore[call-arg]
            return
        # RabbitMQ has no delayed nack: a copy waits in a retry queue, as consume_rabbitmq's do.
        queues = await self.retries() if self.retries is not None else None
        if queues is not None:
            try:
                await queues.send(self.message.raw_message, delay)
            except Exception as error:  # noqa: BLE001 - held in the process instead
                _log.warning(
                    "could not send message %s to a retry queue, holding it for %.1fs: %s",
                    self.message_id,
                    delay,
                    describe(error),
                )
            else:
                await self.message.ack()  # only now: until the copy is confirmed, it is this
                return
        # No retry queue (retry_queues=False, or it could not be declared): hold the message,
        # one prefetch slot, for the delay.
        await stopped_within(stop, delay)
        await self.message.nack()

    async def give_back(self) -> None:
        await self.message.nack()


class FastStreamHandler:
    """What ``inbox_handler`` returns: the guarded handler and its settings; FastStream
    subscribes ``function``, the coroutine function it calls with each message."""

    def __init__(
        self,
        guarded: Guarded,
        *,
        source: str | None,
        rejected: Rejected | None,
        delivery_limit: int | None,
        stop: asyncio.Event,
        retry_queues: bool = True,
    ) -> None:
        self.guarded = guarded
        self.source = source
        self.rejected = rejected
        self.delivery_limit = delivery_limit
        self.stop = stop
        self.retry_queues = retry_queues
        self._queues: dict[str, tuple[_WorkQueue, Any]] = {}  # RetryQueues by work queue
        self._declaring = asyncio.Lock()

    async def handle(self, message: StreamMessage[Any], subscriber: Any = None) -> Outcome | None:
        """Run the guarded handler on one FastStream message and settle it; the outcome, or
        ``None`` for a message rejected before it reached the handler. ``subscriber`` is
        FastStream's (its queue names the RabbitMQ retry queues)."""

        async def retries() -> Any:
            return await self._retry_queues(message, subscriber)

        delivery = _Delivery(message, self.delivery_limit, retries if self.retry_queues else None)
        try:
            return await settle(
                delivery,
                self.guarded,
                source=self.source,
                rejected=self.rejected,
                stop=self.stop,
            )
        except asyncio.CancelledError:
            # FastStream's stop waits for running handlers; cancelled (the stop given up on, a
            # supervisor's timeout), the handler ends here, and the broker has the message again
            # at once, not after its ack wait, or (RabbitMQ) once the connection is gone.
            # (Settled already, FastStream ignores this.)
            await _given_back(delivery)
            raise

    async def _retry_queues(self, message: StreamMessage[Any], subscriber: Any) -> Any:
        """The retry queues of the subscriber's RabbitMQ queue, declared on first use; None
        when there is no queue to name them after or they cannot be declared (the retry is
        then held in the process, as before)."""
        queue = getattr(subscriber, "queue", None)
        name = getattr(queue, "name", None)
        if not isinstance(name, str) or not name:
            return None
        from mongo_outbox.brokers.rabbitmq._retry_queues import RetryQueues

        async with self._declaring:
            known = self._queues.get(name)
            # The channel of the latest delivery: after a reconnection the old one is closed,
            # and the retry queues open theirs on its connection.
            channel = message.raw_message.channel
            if known is not None:
                known[0].current = channel
                return known[1]
            work = _WorkQueue(name, bool(getattr(queue, "exclusive", False)), channel)
            queues = RetryQueues(work, self.guarded.backoff)  # type: ignore[arg-type]
            try:
                await queues.declare()
            except Exception as error:  # noqa: BLE001 - held in the process instead
                _log.error(
                    "inbox_handler: cannot declare the retry queues of %r, holding retries in "
                    "the process: %s",
                    name,
                    describe(error),
                )
                return None
            self._queues[name] = (work, queues)
            return queues


_GIVE_BACK_WAIT = 2.0
"""Seconds a cancelled handler waits for its message to be given back."""


async def _given_back(delivery: _Delivery) -> None:
    # Shielded: a second cancellation stops the wait, not the nack.
    nack = asyncio.ensure_future(delivery.give_back())
    nack.add_done_callback(lambda done: done.cancelled() or done.exception())
    try:
        await asyncio.wait_for(asyncio.shield(nack), _GIVE_BACK_WAIT)
    except (asyncio.TimeoutError, asyncio.CancelledError, Exception) as error:  # noqa: BLE001
        _log.warning(
            "could not give message %s back after its handler was cancelled: %s",
            delivery.message_id,
            describe(error),
        )


def inbox_handler(
    inbox: Inbox,
    *,
    payload: type[BaseModel] | None = None,
    max_attempts: int = 5,
    backoff: Backoff | None = None,
    dead_letter: DeadLetter | None = None,
    source: str | None = None,
    rejected: Rejected | None = None,
    delivery_limit: int | None = None,
    stop: asyncio.Event | None = None,
    upcasters: Upcasters | None = None,
    retry_queues: bool = True,
) -> Callable[[_Handler], Callable[..., Awaitable[None]]]:
    """Decorate ``async def handler(event, session)`` into a FastStream subscriber function
    that runs it once per message::

        @broker.subscriber("orders.>", stream="orders", durable="billing")
        @inbox_handler(Inbox(db, consumer="billing"))
        async def bill(event: Event, session: Any) -> None: ...

    ``session`` is the inbox's MongoDB session (transactional mode: write with it, and the
    handler's writes commit with the inbox record); a handler that takes an ``attempt`` keyword
    gets the attempt number. With ``payload=Model`` the handler gets
    ``event.payload_as(Model)`` instead of the event, and a payload that does not fit is
    dead-lettered at once (it would never fit).

    ``max_attempts``, ``backoff``, ``dead_letter`` and ``upcasters`` are ``inbox_guard``'s (with
    ``payload=Model``, events are brought to the model's ``event_version`` instead of their
    type's latest); ``source`` and
    ``rejected`` those of ``mongo_outbox.consumers``. ``delivery_limit`` is the subscription's
    ``max_deliver`` (NATS) or the quorum queue's ``x-delivery-limit`` (RabbitMQ): on the last
    delivery a failure is dead-lettered instead of lost. Setting ``stop`` (say, in the app's
    ``on_shutdown``) requeues at once a RabbitMQ message held for its retry delay.

    The result is a plain coroutine function taking FastStream's message; its ``inbox``
    attribute is the ``FastStreamHandler`` (``.guarded`` is the ``Guarded``).
    """
    check_source(source, "inbox_handler.source")
    limit = delivery_limit_of(delivery_limit, "inbox_handler.delivery_limit")
    if payload is not None and not (isinstance(payload, type) and issubclass(payload, BaseModel)):
        raise ConfigurationError(
            f"inbox_handler.payload must be a pydantic model class, not {payload!r}",
            setting="inbox_handler.payload",
        )
    guard = inbox_guard(
        inbox,
        max_attempts=max_attempts,
        backoff=backoff,
        dead_letter=dead_letter,
        # With a model, _typed upcasts to the model's version, which may be before the chain's
        # latest; the guard would take it to the latest, past what the model reads.
        upcasters=upcasters if payload is None else None,
    )

    def decorate(handler: _Handler) -> Callable[..., Awaitable[None]]:
        guarded = guard(handler if payload is None else _typed(handler, payload, upcasters))
        settings = FastStreamHandler(
            guarded,
            source=source,
            rejected=rejected,
            delivery_limit=limit,
            stop=stop or asyncio.Event(),
            retry_queues=retry_queues,
        )

        # FastStream builds the subscriber's arguments from this signature: the message
        # itself, and the subscriber delivering it (its queue), from FastStream's context.
        async def subscriber(
            message: Annotated[Any, Context("message")],
            handler: Annotated[Any, Context("handler_", default=None)] = None,
        ) -> None:
            await settings.handle(message, handler)

        subscriber.__name__ = getattr(handler, "__name__", "subscriber")
        subscriber.__qualname__ = getattr(handler, "__qualname__", subscriber.__name__)
        subscriber.__doc__ = handler.__doc__
        subscriber.inbox = settings  # type: ignore[attr-defined]
        return subscriber

    return decorate


def _typed(handler: _Handler, model: type[BaseModel], upcasters: Upcasters | None) -> _Handler:
    wanted = version_of(model)  # its version declared wrongly: refused when decorated
    steps = upcasters or Upcasters()
    reader = f"the model {model.__name__}"

    # functools.wraps keeps the handler's name (the inbox registers it) and its signature (the
    # guard passes ``attempt`` only to a handler that takes it).
    @functools.wraps(handler)
    async def typed(event: Event, session: Any, **keywords: Any) -> None:
        # Upcast apart from validating: a step that fails (raises, returns no payload) fails
        # the attempt as it does in inbox_guard, retried and then dead-lettered; an
        # IncompatibleEventError goes on to the guard, which dead-letters it at once.
        event = steps.upcast(event, wanted, reader=reader)
        try:
            value = event.payload_as(model)
        except InvalidEventError as error:
            # A payload that does not fit the model never will: no retry would help.
            raise PoisonMessage(describe(error)) from error
        await handler(value, session, **keywords)

    return typed
