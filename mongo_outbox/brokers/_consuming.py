"""What every consumer helper shares: the outcome-to-broker table, decoding, and the loop that
runs a guarded handler on a delivery and settles it, one aggregate at a time in ordered mode.
It is the seam below the brokers' consumers.

Outcome to broker action:

==============  =====================================  ==================================
outcome         RabbitMQ                               NATS JetStream
==============  =====================================  ==================================
handled         ack                                    ack
duplicate       ack                                    ack
retry           a confirmed copy to the retry queue    nak(delay=backoff delay)
                of the delay, then ack (held, then
                nack(requeue), without retry queues)
dead-lettered   ack (the dead letter has it)           ack (the dead letter has it)
no usable id    reject, no requeue (to the DLX, if     term
or not an       the queue has one), ``rejected``
Event           callback                               ``rejected`` callback
==============  =====================================  ==================================

Redis Streams (``consume_redis``) acks too, except that a dead-lettered message, and one with no
usable id, moves to the dead-letter stream (XADD and XACK in one transaction), and a retry is
left pending with its idle time set so that it is reclaimed after the backoff delay.

A retry is done in the process instead, the message held unsettled meanwhile, in two cases: in
ordered mode (so that later messages of its aggregate wait behind it), and on the broker's last
delivery of a message (which the broker would not deliver again). On stop, a held message goes
back to the broker at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any, Protocol, runtime_checkable

from pymongo.errors import PyMongoError

from mongo_outbox import cloudevents
from mongo_outbox.errors import (
    ConfigurationError,
    InvalidEventError,
    MessageIdentityError,
    describe,
)
from mongo_outbox.events import Event
from mongo_outbox.inbox import MAX_ID_LENGTH, Guarded, Outcome, check_message_id
from mongo_outbox.settings import check_count
from mongo_outbox.tracing import receiving

log = logging.getLogger(__name__)

Rejected = Callable[[bytes, str], Awaitable[None]]
"""``rejected(body, reason)``: told of a message that could not even be identified or decoded."""


class Delivery(Protocol):
    """One broker delivery, as the settling loop sees it.

    A delivery may also have ``messaging() -> dict[str, str]``: the OpenTelemetry attributes
    of its consumer span (``messaging.system``, ``messaging.destination.name``, ...), a
    ``content_type`` (a broker's own property), and ``percent_encoded = False`` when a
    CloudEvent's ``ce-`` headers come unencoded (RabbitMQ's: ``cloudevents.read_binary``).
    """

    message_id: object
    body: bytes
    headers: Mapping[str, Any]
    last: bool
    """The broker will not deliver this message again (its delivery limit is reached)."""

    async def ack(self) -> None: ...

    async def reject(self) -> None:
        """Refuse it for good (RabbitMQ: to the dead-letter exchange; NATS: term)."""

    async def retry_after(self, delay: float, stop: asyncio.Event) -> None:
        """Have the broker deliver it again after ``delay`` seconds (sooner once ``stop``)."""

    async def give_back(self) -> None:
        """Return it to the broker for delivery again now."""


@runtime_checkable
class DeadLetterDelivery(Delivery, Protocol):
    """A delivery from a broker that has no dead-letter destination of its own (Redis): the
    consumer moves a dead-lettered message there itself, instead of acknowledging it."""

    async def dead_letter(self, reason: str) -> None: ...


def decode(message_id: object, body: bytes) -> Event | str:
    """The message's Event, or why it cannot be handled at all."""
    try:
        check_message_id(message_id)
    except MessageIdentityError as error:
        return f"{error}; not processed"
    try:
        # Not upcast here: the guard does it inside an attempt, so that an event of a version
        # the consumer cannot read is dead-lettered with its inbox record (to be requeued once
        # a reader that knows it is deployed), not rejected without one.
        return Event.from_json(body)
    except InvalidEventError as error:
        return f"message {message_id} is not an Event: {error}"
    except Exception as error:  # noqa: BLE001 - any body no Event comes of is refused once
        # Not given back: it would come back at once, for ever (a hot loop on RabbitMQ).
        return f"message {message_id} is not an Event: {describe(error)}"


def decode_delivery(delivery: Delivery, source: str | None) -> tuple[Event, str, str | None] | str:
    """The delivery's Event, message id and inbox source, or why it cannot be handled at all.

    A CloudEvent (by its headers or content type, ``mongo_outbox.cloudevents``) is identified
    by its own ``source`` and ``id``, which the specification makes unique across producers;
    any other message by its broker message id and the consumer's ``source``."""
    content_type = getattr(delivery, "content_type", None)
    if content_type is None:
        content_type = next(
            (v for k, v in delivery.headers.items() if k.lower() == "content-type"), None
        )
    if not isinstance(content_type, str):
        content_type = None
    if cloudevents.is_cloudevent(delivery.headers, content_type):
        try:
            received = cloudevents.read_message(
                delivery.headers,
                delivery.body,
                content_type=content_type,
                percent_encoded=getattr(delivery, "percent_encoded", True),
            )
            check_message_id(received.source, what="CloudEvent source")
            check_message_id(received.id, what="CloudEvent id")
        except (InvalidEventError, MessageIdentityError) as error:
            return f"message {delivery.message_id} is not a usable CloudEvent: {error}"
        return received.event, received.id, received.source
    event = decode(delivery.message_id, delivery.body)
    if isinstance(event, str):
        return event
    return event, str(delivery.message_id), source


def check_source(source: str | None, setting: str) -> None:
    if source is not None and (not isinstance(source, str) or len(source) > MAX_ID_LENGTH):
        raise ConfigurationError(
            f"{setting} must be a str of at most {MAX_ID_LENGTH} characters, not {source!r}",
            setting=setting,
        )


def delivery_limit_of(value: int | None, setting: str) -> int | None:
    """A broker's delivery limit: ``None`` (unknown or unlimited) or a count ``>= 0``."""
    return None if value is None else check_count(value, setting, minimum=0)


def aggregate_key(headers: Mapping[str, Any]) -> tuple[str, str] | None:
    """The aggregate a message belongs to, from the headers the publishers send."""
    aggregate_id = headers.get("aggregate-id")
    if aggregate_id is None:
        return None
    return (_text(headers.get("aggregate-type", "")), _text(aggregate_id))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def stopped_within(stop: asyncio.Event, delay: float) -> bool:
    """Wait ``delay`` seconds or until ``stop`` is set; whether it was set."""
    try:
        await asyncio.wait_for(stop.wait(), delay)
    except asyncio.TimeoutError:
        return False
    return True


async def settle(
    delivery: Delivery,
    guarded: Guarded,
    *,
    source: str | None,
    rejected: Rejected | None,
    stop: asyncio.Event,
    hold: bool = False,
) -> Outcome | None:
    """Run ``guarded`` on the delivery and settle it with the broker; the outcome, or ``None``
    for a message rejected before it reached the handler. ``hold`` retries in the process."""
    decoded = decode_delivery(delivery, source)
    if isinstance(decoded, str):
        log.error("rejecting message: %s", decoded)
        try:
            if rejected is not None:
                await rejected(delivery.body, decoded)
        finally:
            await delivery.reject()  # whatever the callback did: never redelivered for ever
        return None
    event, message_id, source = decoded
    while True:
        if stop.is_set():
            # Not started, or held for a retry: the broker has it again at once.
            await _give_back(delivery, message_id)
            return Outcome.RETRY
        with receiving(delivery):
            result = await guarded.handle(
                event, message_id=message_id, source=source, last_delivery=delivery.last
            )
        if result.outcome is Outcome.DEAD_LETTERED and isinstance(delivery, DeadLetterDelivery):
            await delivery.dead_letter(result.error or "dead-lettered")
            return result.outcome
        if result.outcome is not Outcome.RETRY:
            await delivery.ack()
            return result.outcome
        if not (hold or delivery.last):
            await delivery.retry_after(result.delay, stop)
            return result.outcome
        await stopped_within(stop, result.delay)


async def _give_back(delivery: Delivery, message_id: str) -> None:
    if delivery.last:
        # Nothing else can be done: the alternative would be to keep the consumer from stopping.
        log.error(
            "message %s goes back to the broker on its last delivery: the broker will drop it",
            message_id,
        )
    await delivery.give_back()


def being_cancelled() -> bool:
    """In a ``finally`` block: whether it runs because its task was cancelled."""
    return isinstance(sys.exc_info()[1], asyncio.CancelledError)


async def ready(guarded: Guarded) -> None:
    """Before a consumer takes its first delivery: the inbox's indexes made, or the
    ``ConfigurationError`` that says why they cannot be, so a consumer that cannot deduplicate
    does not start (and uses up no message's deliveries finding out). MongoDB out of reach is
    left to the guard, which retries each message."""
    try:
        await guarded.prepare()
    except PyMongoError as error:
        log.warning("inbox of %s unavailable at start: %s", guarded.inbox.consumer, error)


_GIVE_BACK_WAIT = 5.0
"""Seconds a cancelled consumer waits for its cancelled handlers to give their messages back."""


class Dispatcher:
    """Settles deliveries in tasks of their own; in ordered mode one aggregate at a time.

    Deliveries of one aggregate (keyed on the ``aggregate-type`` and ``aggregate-id`` headers)
    run one after another in the order they were dispatched, each including its retries;
    different aggregates, and messages without those headers, run side by side.
    """

    def __init__(
        self,
        guarded: Guarded,
        *,
        source: str | None,
        rejected: Rejected | None,
        ordered: bool,
    ) -> None:
        self.guarded = guarded
        self.source = source
        self.rejected = rejected
        self.ordered = ordered
        self.stop = asyncio.Event()
        """Set when the consumer stops: held and waiting messages go back to the broker."""
        self.in_flight: dict[asyncio.Task[None], Delivery] = {}
        self._tails: dict[Hashable, asyncio.Task[None]] = {}

    def dispatch(self, delivery: Delivery) -> None:
        """Start settling ``delivery``. Not a coroutine: called in delivery order, each lane's
        order is fixed before anything runs."""
        key = aggregate_key(delivery.headers) if self.ordered else None
        previous = self._tails.get(key) if key is not None else None
        task = asyncio.create_task(self._run(delivery, previous))
        self.in_flight[task] = delivery
        task.add_done_callback(self._done)
        if key is not None:
            self._tails[key] = task
            task.add_done_callback(lambda done: self._untail(key, done))

    async def _run(self, delivery: Delivery, previous: asyncio.Task[None] | None) -> None:
        try:
            if previous is not None:
                # Its failure is its own; only its end matters here. (Inside the try: cancelled
                # while it waits its turn, this message too goes back.)
                await asyncio.wait([previous])
            await settle(
                delivery,
                self.guarded,
                source=self.source,
                rejected=self.rejected,
                stop=self.stop,
                hold=self.ordered,
            )
        except asyncio.CancelledError:
            # The consumer ended without waiting for it (Dispatcher.drain): the broker has it
            # again at once, rather than when its ack wait runs out.
            with contextlib.suppress(Exception):
                await _give_back(delivery, str(delivery.message_id))
            raise
        except Exception as error:  # noqa: BLE001 - one message must not stop the others
            log.error("could not settle message %s: %s", delivery.message_id, describe(error))
            # Give it back rather than hold its slot until the connection closes; if the
            # connection is what failed, the broker has it again anyway.
            with contextlib.suppress(Exception):
                await _give_back(delivery, str(delivery.message_id))

    def _done(self, task: asyncio.Task[None]) -> None:
        self.in_flight.pop(task, None)

    def _untail(self, key: Hashable, task: asyncio.Task[None]) -> None:
        if self._tails.get(key) is task:
            del self._tails[key]

    async def room(self, limit: int, stop: asyncio.Event) -> None:
        """Wait until fewer than ``limit`` deliveries are in flight, or ``stop`` is set."""
        while len(self.in_flight) >= limit and not stop.is_set():
            await asyncio.wait(
                list(self.in_flight), timeout=0.5, return_when=asyncio.FIRST_COMPLETED
            )

    async def drain(self, *, cancelled: bool = False) -> None:
        """Stop: running handlers finish and settle; held and waiting messages are given back.
        Cancelled meanwhile (a stop that would not wait), or ``cancelled`` already (the
        consumer was cancelled before its drain began: ``being_cancelled()``), the handlers are
        cancelled too and their messages given back: none is left running, or held, after the
        consumer ends. (A drain that waited there would wait for a hanging handler for ever.)"""
        self.stop.set()
        if cancelled:
            await self._cancel_handlers()
            return
        try:
            while self.in_flight:
                await asyncio.wait(list(self.in_flight))
        except asyncio.CancelledError:
            await self._cancel_handlers()
            raise

    async def _cancel_handlers(self) -> None:
        running = list(self.in_flight)
        for task in running:
            task.cancel()
        if running:
            # Each gives its message back as it ends; a handler that ignores cancellation
            # is not waited for long.
            await asyncio.wait(running, timeout=_GIVE_BACK_WAIT)
