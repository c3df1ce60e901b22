"""RabbitMQPublisher: RabbitMQ with publisher confirms and AMQP ``message_id``.

aio-pika connects (and reconnects) and declares; publishing goes below it, on a confirming
channel of the publisher's own (``_confirms``): aio-pika's per-message costs were most of
the time a publish took."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, cast

from mongo_outbox.brokers._publishing import (
    Naming,
    NamingFailed,
    check_naming,
    client_call,
    closed_error,
    message_headers,
    redact_url,
    render,
    unavailable_error,
)
from mongo_outbox.cloudevents import CloudEvents, check_option, message_of
from mongo_outbox.errors import (
    BrokerFullError,
    BrokerUnavailableError,
    ConfigurationError,
    InvalidEventError,
    PublishError,
    describe,
)
from mongo_outbox.events import SHORT_STRING_BYTES, Event
from mongo_outbox.settings import Duration, check_count, check_seconds

try:
    import aio_pika
    import aiormq
    from aio_pika.abc import AbstractExchange, AbstractRobustChannel, AbstractRobustConnection
    from aio_pika.connection import make_url

    from mongo_outbox.brokers.rabbitmq._confirms import (
        PENDING,
        ConfirmWindow,
        Encoder,
        ReturnKey,
    )
    from mongo_outbox.brokers.rabbitmq.errors import REFUSED, answer_error, classify
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "RabbitMQPublisher needs the rabbitmq extra: pip install 'mongo-outbox[rabbitmq]'"
    ) from error

log = logging.getLogger(__name__)

_FIELD_NAME_BYTES = 128  # AMQP 0-9-1's limit on a field table's names (the headers)


def routing_key_of(naming: Naming, event: Event) -> str:
    """The routing key ``naming`` gives ``event``; ``InvalidEventError`` if it cannot be rendered
    or is longer than AMQP allows."""
    key = render(naming, event)
    if len(key.encode()) > SHORT_STRING_BYTES:
        raise InvalidEventError(f"routing key {key[:40]!r}... is too long", event_id=event.id)
    return key


def _checked_size(max_message_size: int | None) -> int | None:
    if max_message_size is None:
        return None
    return check_count(max_message_size, "RabbitMQPublisher.max_message_size")


class RabbitMQPublisher:
    """Publishes each event as a persistent message and waits for the broker's confirm.

    It publishes on a channel of its own in confirm mode, opened on the connection of the
    exchange's channel, and reopened after that channel or connection closed; ``publish_many``
    writes a whole chunk at once and waits for the confirms of all. Messages are
    ``mandatory``: one that no queue is bound for comes
    back as an error and is retried, rather than confirmed and dropped. These failures are
    not the event's and raise ``BrokerUnavailableError``, so the relay waits without parking
    anything: the connection is down, no queue is bound, the exchange does not exist (the
    broker then closes the channel, and the next publish reopens it), and ``BrokerFullError``
    for a nack (a queue at its ``x-max-length`` with ``reject-publish``). An event the
    connection cannot carry (its properties and headers over the negotiated ``frame_max``, a
    type over 255 bytes, a header name over 128) raises ``InvalidEventError`` before it is
    sent.

    Parameters:
        exchange: an aio-pika exchange; its connection stays the caller's (use
            ``connect_robust``: a plain connection that closes stays closed).
        routing_key: template or function giving the routing key; default ``"{type}"``.
        timeout: seconds (or a ``timedelta``) a publish may take, reopening the channel
            included, before it raises ``BrokerUnavailableError`` (and the connection's
            timeout, in ``connect``).
        max_message_size: the broker's ``max_message_size`` in bytes; by default its
            version's default (RabbitMQ 4: 16 MiB, 3: 128 MiB). A longer message raises
            ``InvalidEventError`` before it is sent.
        cloudevents: publish CloudEvents 1.0 (``mongo_outbox.cloudevents``): in binary mode
            the attributes as ``cloudEvents_`` headers (the AMQP binding's application
            properties) and the payload as the body, content type ``application/json``; in
            structured mode one ``application/cloudevents+json`` document; ``None`` (the
            default), the Event's own JSON.
    """

    def __init__(
        self,
        exchange: AbstractExchange,
        *,
        routing_key: Naming = "{type}",
        timeout: Duration = 5.0,
        max_message_size: int | None = None,
        cloudevents: CloudEvents | None = None,
    ) -> None:
        self.exchange = exchange
        self.cloudevents = check_option(cloudevents, "RabbitMQPublisher.cloudevents")
        self.routing_key = check_naming(routing_key, "RabbitMQPublisher.routing_key", empty=True)
        self.timeout = check_seconds(timeout, "RabbitMQPublisher.timeout")
        self.max_message_size = _checked_size(max_message_size)
        self.closed = False
        self.connection: AbstractRobustConnection | None = None
        """The connection ``connect`` opened, which ``aclose`` closes; else ``None``."""
        self._reopening = asyncio.Lock()
        self._opening = asyncio.Lock()
        self._confirms: ConfirmWindow | None = None
        self._encoder = Encoder(getattr(exchange, "name", ""))

    @classmethod
    async def connect(
        cls,
        url: str = "amqp://guest:guest@127.0.0.1/",
        *,
        exchange: str = "events",
        routing_key: Naming = "{type}",
        timeout: Duration = 5.0,
        declare: bool = True,
        max_message_size: int | None = None,
        cloudevents: CloudEvents | None = None,
    ) -> RabbitMQPublisher:
        """Open a connection of its own and declare ``exchange`` as a durable topic exchange;
        with ``declare=False`` the exchange must exist already (a misspelled name is refused
        instead of declared): ``ConfigurationError`` otherwise.

        Raises ``ConnectionError`` when RabbitMQ cannot be reached; it shows ``url`` without
        its password."""
        wait = check_seconds(timeout, "RabbitMQPublisher.timeout")
        # Before a connection exists that would outlive a refusal.
        check_naming(routing_key, "RabbitMQPublisher.routing_key", empty=True)
        _checked_size(max_message_size)
        check_option(cloudevents, "RabbitMQPublisher.cloudevents")
        connection = aio_pika.RobustConnection(make_url(url))
        try:
            # The outer bound is for Python 3.10, whose asyncio.TimeoutError aio-pika does not
            # take for a failed attempt: its first connect then retried forever, never failing.
            await asyncio.wait_for(connection.connect(timeout=wait), wait)
        except BaseException as error:
            # A robust connection reconnects from a task of its own, which outlives a cancelled
            # connect and shrugs off cancellation itself: only close() ends it. Left open, it
            # retried forever and the event loop of a stopped command never finished.
            await connection.close()
            if isinstance(error, (asyncio.TimeoutError, TimeoutError)):  # it says nothing itself
                raise ConnectionError(
                    f"RabbitMQ at {redact_url(url)}: no answer within {wait:g}s"
                ) from error
            if isinstance(error, (aiormq.exceptions.AMQPError, OSError)):
                raise ConnectionError(
                    f"RabbitMQ at {redact_url(url)}: {describe(error)}"
                ) from error
            raise
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            if declare:
                declared = await channel.declare_exchange(
                    exchange, aio_pika.ExchangeType.TOPIC, durable=True, timeout=wait
                )
            else:
                # A passive declare: it only checks that the exchange is there.
                declared = await channel.declare_exchange(exchange, passive=True, timeout=wait)
        except aiormq.exceptions.ChannelNotFoundEntity:
            await connection.close()
            raise ConfigurationError(
                f"RabbitMQ at {redact_url(url)} has no exchange {exchange!r}",
                setting="RabbitMQPublisher.exchange",
            ) from None
        except BaseException:
            await connection.close()
            raise
        publisher = cls(
            declared,
            routing_key=routing_key,
            timeout=wait,
            max_message_size=max_message_size,
            cloudevents=cloudevents,
        )
        publisher.connection = connection
        return publisher

    def routing_key_for(self, event: Event) -> str:
        return routing_key_of(self.routing_key, event)

    def messaging_attributes(self, event: Event) -> dict[str, str]:
        """The OpenTelemetry messaging attributes of ``event``'s publish span."""
        return {
            "messaging.system": "rabbitmq",
            "messaging.destination.name": self.exchange.name,
            "messaging.rabbitmq.destination.routing_key": self.routing_key_for(event),
        }

    async def publish(self, event: Event) -> None:
        [error] = await self.publish_many([event])
        if error is not None:
            raise error

    async def publish_many(self, events: Sequence[Event]) -> list[BaseException | None]:
        """Publish ``events`` in one write on the publisher's own confirming channel, then wait
        for the confirms of them all (one ``multiple`` ack may cover many): one result per
        event, ``None`` once the broker confirmed that event."""
        if self.closed:
            return [closed_error(self, event) for event in events]
        if not events:
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        first = events[0]
        try:
            # Bounded, and a cancellation from the client (its connection closing under the
            # call) is a failure, not the caller's: as for every call below.
            window = await client_call(
                self._window(first), self.timeout, lambda reason: self._failed(first, reason)
            )
        except BrokerUnavailableError as error:
            return [self._failed_to_open(event, error) for event in events]
        results: list[BaseException | None] = [None] * len(events)
        frames: list[bytes] = []
        sent: list[int] = []  # the position in ``events`` of each message sent
        keys: list[ReturnKey] = []  # each one's routing key and body
        for index, event in enumerate(events):
            try:
                key, body, frame = self._frames(window, event)
            except (InvalidEventError, NamingFailed) as error:
                results[index] = error
                continue
            except Exception as error:  # noqa: BLE001 - this event's alone, not its wave's
                results[index] = _unencoded(event, error)
                continue
            frames.append(frame)
            sent.append(index)
            keys.append((key, body))
        if not frames:
            return results
        failure: BaseException | None = None
        left = max(0.0, deadline - loop.time())
        try:
            wave = await client_call(
                window.send(frames, keys), left, lambda reason: _Unsent(reason)
            )
        except (
            asyncio.TimeoutError,
            aiormq.exceptions.AMQPError,
            aiormq.exceptions.ChannelInvalidStateError,
            _Unsent,
        ) as error:
            failure = None if isinstance(error, (asyncio.TimeoutError, _Unsent)) else error
            late = self._late(window, "nothing written", sum(map(len, frames)))
            for position, index in enumerate(sent):
                results[index] = self._result(
                    events[index], PENDING, failure, keys[position][0], late
                )
            return results
        # Settled, failed with the channel, or not in time: a wave left unsettled stays the
        # window's until the broker confirms it (its tags and bytes are still the broker's).
        await asyncio.wait((wave.done,), timeout=max(0.0, deadline - loop.time()))
        if wave.done.done():
            failure = (
                aiormq.exceptions.ChannelInvalidStateError("the channel closed")
                if wave.done.cancelled()
                else wave.done.exception()
            )
        late = self._late(window, "no confirm", 0)
        for position, index in enumerate(sent):
            results[index] = self._result(
                events[index], wave.outcome(position), failure, keys[position][0], late
            )
        return results

    def _frames(self, window: ConfirmWindow, event: Event) -> tuple[str, bytes, bytes]:
        """The routing key, the body and the frames of ``event``'s message;
        ``InvalidEventError`` if AMQP cannot carry it on this connection."""
        key = self.routing_key_for(event)
        # The type is an AMQP short string (the id and correlation_id are limited when the
        # event is built); a header name is at most 128 bytes, and pamqp would cut a longer
        # one (the encoder here would send a malformed frame).
        if len(event.type.encode()) > SHORT_STRING_BYTES:
            raise InvalidEventError(
                f"type {event.type[:40]!r}... is longer than an AMQP short string",
                event_id=event.id,
            )
        for name in event.headers:
            if len(name) > _FIELD_NAME_BYTES:  # a token: one byte per character
                raise InvalidEventError(
                    f"header name {name[:40]!r}... is longer than AMQP's {_FIELD_NAME_BYTES}",
                    event_id=event.id,
                )
        # The AMQP binding's application properties are AMQP 0-9-1 headers on RabbitMQ;
        # cloudEvents_ rather than cloudEvents:, which JMS cannot name (the binding's advice).
        headers, content_type, body = message_of(
            event, self.cloudevents, "cloudEvents_", message_headers(event)
        )
        limit = self.max_message_size or window.message_max
        if len(body) > limit:
            # Sent, the broker would close the channel (PRECONDITION_FAILED), failing every
            # other message of its wave with it.
            raise InvalidEventError(
                f"event {event.id}: its message takes {len(body)} bytes, over "
                f"max_message_size {limit} (RabbitMQ's max_message_size)",
                event_id=event.id,
            )
        number = window.channel.number
        header = self._encoder.content_header(
            number,
            len(body),
            headers=headers,
            content_type=content_type,
            message_id=event.id,
            message_type=event.type,
            timestamp=event.occurred_at,
            correlation_id=event.correlation_id,
        )
        # RabbitMQ closes the whole connection (FRAME_ERROR), failing every other publish on
        # it, for a content header frame over frame_max: the properties cannot be split.
        frame_max = window.frame_max
        if frame_max and len(header) > frame_max:
            raise InvalidEventError(
                f"event {event.id}: its AMQP properties and headers take {len(header)} bytes, "
                f"over the connection's frame_max of {frame_max}",
                event_id=event.id,
            )
        method = self._encoder.method(number, key)
        return key, body, method + header + self._encoder.body(number, body, frame_max)

    def _late(self, window: ConfirmWindow, what: str, size: int) -> str:
        """``what`` happened within the timeout (nothing written of a wave of ``size`` bytes,
        no confirm), and why, as far as the client can tell."""
        reason = f"{what} within {self.timeout:g}s"
        stalled = window.stalled(size)
        return f"{reason}: {stalled}" if stalled else reason

    def _result(
        self,
        event: Event,
        outcome: Any,
        failure: BaseException | None,
        key: str,
        late: str | None = None,
    ) -> BaseException | None:
        """The event's confirm (``outcome``) as the relay acts on it (``errors.classify``);
        ``failure``: why the wave stopped waiting, for an event still without its confirm, or
        none, and then ``late`` says why."""
        if outcome is None:
            return None  # acked
        # Returned unroutable (NO_ROUTE: the broker is up, no queue is bound for the key), or a
        # nack (a queue at its limit with reject-publish, or the broker could not store the
        # message): neither is the event's fault; retrying earlier events first keeps the
        # aggregate's order.
        cause = answer_error(outcome) or failure
        if cause is None:
            return self._failed(event, late or f"no confirm within {self.timeout:g}s")
        error = classify(cause, event, key)
        if error is None:
            if isinstance(cause, REFUSED) and not self.closed:
                return cause  # the broker closed the channel over what was sent: an attempt
            # The channel or connection closed under the wave, however the client words it
            # (a reset socket, an incomplete read): an outage.
            error = unavailable_error("RabbitMQ", cause, event)
        if self.closed and not isinstance(error, BrokerFullError):
            # Closed while the publish was in flight: that is why it failed, whatever the
            # client says (a closed channel, a timeout).
            error = closed_error(self, event)
        error.__cause__ = cause
        return error

    def _failed_to_open(self, event: Event, error: BrokerUnavailableError) -> BaseException:
        if self.closed:
            return closed_error(self, event)
        copy = BrokerUnavailableError(str(error), event_id=event.id)
        copy.__cause__ = error.__cause__
        return copy

    async def _window(self, event: Event) -> ConfirmWindow:
        """The publisher's own confirming channel, on the connection of the exchange's channel,
        opened again after it closed (a 404 or 403 closes it, and so does a dropped connection,
        which ``connect_robust`` reopens)."""
        window = self._confirms
        if window is not None and not window.is_closed:
            return window
        async with self._opening:
            window = self._confirms
            if window is not None and not window.is_closed:
                return window
            underlay = await self._open_channel(event)
            if window is not None and not window.channel.is_closed:
                with contextlib.suppress(Exception):  # the broker closes it already
                    await window.close(self.timeout)
            try:
                window = await ConfirmWindow.open(underlay.connection, self.timeout)
            except Exception as error:
                raise unavailable_error("RabbitMQ", error, event) from error
            if self.closed:
                # aclose ran meanwhile: the channel would outlive the publisher.
                with contextlib.suppress(Exception):
                    await window.close(self.timeout)
                raise closed_error(self, event)
            if self._confirms is not None:
                log.info("reopened the publishing channel of exchange %r", self.exchange.name)
            self._confirms = window
            return window

    async def _open_channel(self, event: Event) -> Any:
        # AbstractExchange does not declare it; every aio-pika exchange has it.
        channel = cast(aio_pika.Exchange, self.exchange).channel
        if channel.is_closed:
            # The broker closes the channel on a 404 or 403, and aio-pika reopens it only when
            # it can redeclare the exchange at once (never a plain channel): reopen it here, so
            # publishing resumes as soon as the exchange is back.
            async with self._reopening:
                if channel.is_closed:
                    try:
                        if isinstance(channel, AbstractRobustChannel):
                            await asyncio.wait_for(channel.restore(), self.timeout)
                        else:
                            await asyncio.wait_for(channel.reopen(), self.timeout)
                    except Exception as error:
                        # The connection is down or closed, or the exchange is still missing:
                        # the broker is not ready, whatever the client calls it.
                        raise unavailable_error("RabbitMQ", error, event) from error
                    if not channel.is_closed:
                        log.info("reopened the channel of exchange %r", self.exchange.name)
            if channel.is_closed:
                # Not reopened, as while connect_robust reconnects: fail now, not at the timeout.
                closed = aiormq.exceptions.ChannelInvalidStateError(f"{channel!r} is closed")
                raise unavailable_error("RabbitMQ", closed, event)
        return await channel.get_underlay_channel()

    def _failed(self, event: Event, reason: str) -> BrokerUnavailableError:
        if self.closed:
            return closed_error(self, event)
        return BrokerUnavailableError(f"RabbitMQ: {reason}", event_id=event.id)

    async def aclose(self) -> None:
        """Stop publishing and close the connection ``connect`` opened. Never raises."""
        self.closed = True
        window, self._confirms = self._confirms, None
        if window is not None and not window.channel.is_closed:
            # The publisher's own channel, on a connection that may be the caller's.
            try:
                await window.close(self.timeout)
            except Exception as error:  # noqa: BLE001 - closing must not fail the caller
                log.debug("closing the RabbitMQ publishing channel: %s", describe(error))
        if self.connection is not None and not self.connection.is_closed:
            try:
                await self.connection.close()
            except Exception as error:  # noqa: BLE001 - closing must not fail the caller
                log.debug("closing the RabbitMQ connection: %s", describe(error))


def _unencoded(event: Event, error: Exception) -> PublishError:
    """An event whose message could not be built, for a reason no check foresaw (a routing key
    whose encoding fails, say): a failed attempt of this event alone, retried and parked after
    ``max_attempts`` like any, while the rest of its wave goes out."""
    failure = PublishError(
        f"RabbitMQ: event {event.id} cannot be encoded as an AMQP message: {describe(error)}",
        event_id=event.id,
    )
    failure.__cause__ = error
    return failure


class _Unsent(Exception):
    """A wave not written in time, or cancelled by the client (its connection closed)."""
