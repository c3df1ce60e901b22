"""RabbitMQPublisher: RabbitMQ through aio-pika, with publisher confirms and AMQP ``message_id``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from mongo_outbox.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    InvalidEventError,
    PublishError,
    describe,
)
from mongo_outbox.events import SHORT_STRING_BYTES, Event
from mongo_outbox.publishers.base import (
    Naming,
    client_call,
    closed_error,
    full_error,
    message_headers,
    redact_url,
    render,
    unavailable_error,
)
from mongo_outbox.settings import Duration, seconds

try:
    import aio_pika
    import aiormq
    import pamqp.frame
    import pamqp.header
    from aio_pika.abc import AbstractExchange, AbstractRobustChannel, AbstractRobustConnection
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "RabbitMQPublisher needs the rabbitmq extra: pip install 'mongo-outbox[rabbitmq]'"
    ) from error

log = logging.getLogger(__name__)

# Not the message's fault, each retried without counting an attempt: no confirm in time; the
# connection is down; its channel is closed (while connect_robust reopens it); or the broker
# closed the channel because the exchange does not exist (404 NOT_FOUND) or may not be written
# to (403 ACCESS_REFUSED), which an operator fixes. A message no queue is bound for (returned
# as unroutable, aiormq's PublishError) is caught on its own, before the nacks it derives from.
_UNAVAILABLE = (
    asyncio.TimeoutError,  # not the builtin TimeoutError before Python 3.11
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ChannelNotFoundEntity,
    aiormq.exceptions.ChannelAccessRefused,
)

_FIELD_NAME_BYTES = 128  # AMQP 0-9-1's limit on a field table's names (the headers)
_PERSISTENT = int(aio_pika.DeliveryMode.PERSISTENT)


def routing_key_of(naming: Naming, event: Event) -> str:
    """The routing key ``naming`` gives ``event``; ``InvalidEventError`` if it cannot be rendered
    or is longer than AMQP allows."""
    key = render(naming, event)
    if len(key.encode()) > SHORT_STRING_BYTES:
        raise InvalidEventError(f"routing key {key[:40]!r}... is too long", event_id=event.id)
    return key


class RabbitMQPublisher:
    """Publishes each event as a persistent message and waits for the broker's confirm.

    The exchange's channel must have publisher confirms on (``connect`` does that, with
    ``on_return_raises``). Messages are ``mandatory``: one that no queue is bound for comes
    back as an error and is retried, rather than confirmed and dropped. These failures are
    not the event's and raise ``BrokerUnavailableError``, so the relay waits without parking
    anything: the connection is down, no queue is bound, the exchange does not exist (the
    broker then closes the channel, and the next publish reopens it), and ``BrokerFullError``
    for a nack (a queue at its ``x-max-length`` with ``reject-publish``). An event the
    connection cannot carry (its properties and headers over the negotiated ``frame_max``, a
    type over 255 bytes, a header name over 128) raises ``InvalidEventError`` before it is
    sent.

    Parameters:
        exchange: an aio-pika exchange on a channel with publisher confirms; its connection
            stays the caller's (use ``connect_robust``: a plain connection that closes stays
            closed).
        routing_key: template or function giving the routing key; default ``"{type}"``.
        timeout: seconds (or a ``timedelta``) a publish may take, reopening the channel
            included, before it raises ``BrokerUnavailableError`` (and the connection's
            timeout, in ``connect``).
    """

    def __init__(
        self,
        exchange: AbstractExchange,
        *,
        routing_key: Naming = "{type}",
        timeout: Duration = 5.0,
    ) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.timeout = seconds(timeout, "RabbitMQPublisher.timeout")
        self.closed = False
        self.connection: AbstractRobustConnection | None = None
        """The connection ``connect`` opened, which ``aclose`` closes; else ``None``."""
        self._reopening = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        url: str = "amqp://guest:guest@127.0.0.1/",
        *,
        exchange: str = "events",
        routing_key: Naming = "{type}",
        timeout: Duration = 5.0,
        declare: bool = True,
    ) -> RabbitMQPublisher:
        """Open a connection of its own and declare ``exchange`` as a durable topic exchange;
        with ``declare=False`` the exchange must exist already (a misspelled name is refused
        instead of declared): ``ConfigurationError`` otherwise.

        Raises ``ConnectionError`` when RabbitMQ cannot be reached; it shows ``url`` without
        its password."""
        wait = seconds(timeout, "RabbitMQPublisher.timeout")
        try:
            connection = await aio_pika.connect_robust(url, timeout=wait)
        except (aiormq.exceptions.AMQPError, OSError, asyncio.TimeoutError) as error:
            raise ConnectionError(f"RabbitMQ at {redact_url(url)}: {describe(error)}") from error
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
        publisher = cls(declared, routing_key=routing_key, timeout=wait)
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
        if self.closed:
            raise closed_error(self, event)
        key = self.routing_key_for(event)
        # The type is an AMQP short string (the id and correlation_id are limited when the
        # event is built); a header name is at most 128 bytes, and pamqp silently cuts a
        # longer one.
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
        headers = message_headers(event)
        # The properties as aio-pika's Message would build them, without building the Message:
        # that took a third of the time a publish spends in this process.
        properties = aiormq.spec.Basic.Properties(
            content_type="application/json",
            correlation_id=event.correlation_id,
            delivery_mode=_PERSISTENT,
            headers=headers,  # type: ignore[arg-type]
            message_id=event.id,
            message_type=event.type,
            priority=0,
            timestamp=event.occurred_at,
        )
        body = event.model_dump_json().encode()
        try:
            confirm = await client_call(
                self._send(event, body, properties, key, headers),
                self.timeout,
                lambda reason: self._failed(event, reason),
            )
        except aiormq.exceptions.PublishError as error:
            # Returned unroutable (NO_ROUTE): the broker is up, no queue is bound for the key.
            raise self._unavailable(event, error, destination=key) from error
        except aiormq.exceptions.DeliveryError as error:
            # A nack: a queue at its limit with reject-publish, or the broker could not store
            # the message. Neither is the event's fault; retrying earlier events first keeps
            # the aggregate's order.
            raise full_error("RabbitMQ", error, event) from error
        except _UNAVAILABLE as error:
            raise self._unavailable(event, error) from error
        # Without confirms the result is None, and without on_return_raises a returned
        # message comes back as the result: neither means the broker has the message.
        if not isinstance(confirm, aiormq.spec.Basic.Ack):
            raise PublishError(
                f"RabbitMQ did not confirm event {event.id}: {confirm!r}", event_id=event.id
            )

    async def _send(
        self,
        event: Event,
        body: bytes,
        properties: aiormq.spec.Basic.Properties,
        key: str,
        headers: dict[str, str],
    ) -> Any:
        channel = await self._open_channel(event)
        # RabbitMQ closes the whole connection (FRAME_ERROR), failing every other publish on
        # it, for a content header frame over frame_max: the properties cannot be split.
        frame_max = channel.connection.connection_tune.frame_max
        if frame_max and _header_bound(headers) > frame_max:
            # Only a message that may be too big pays for marshalling its header exactly.
            header = pamqp.header.ContentHeader(0, len(body), properties)
            size = len(pamqp.frame.marshal(header, channel.number))
        else:
            size = 0
        if frame_max and size > frame_max:
            raise InvalidEventError(
                f"event {event.id}: its AMQP properties and headers take {size} bytes, over "
                f"the connection's frame_max of {frame_max}",
                event_id=event.id,
            )
        # What aio-pika's exchange.publish does, straight on the channel it would use. No
        # timeout of its own: publish bounds the whole send with one (a timer each is a cost).
        return await channel.basic_publish(
            body,
            exchange=self.exchange.name,
            routing_key=key,
            properties=properties,
            mandatory=True,
        )

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

    def _unavailable(
        self, event: Event, error: BaseException, *, destination: str | None = None
    ) -> BrokerUnavailableError:
        # Closed while the publish was in flight: that is why it failed, whatever the client
        # says (a closed channel, a timeout).
        if self.closed:
            return closed_error(self, event)
        return unavailable_error("RabbitMQ", error, event, destination=destination)

    def _failed(self, event: Event, reason: str) -> BrokerUnavailableError:
        if self.closed:
            return closed_error(self, event)
        return BrokerUnavailableError(f"RabbitMQ: {reason}", event_id=event.id)

    async def aclose(self) -> None:
        """Stop publishing and close the connection ``connect`` opened. Never raises."""
        self.closed = True
        if self.connection is not None and not self.connection.is_closed:
            try:
                await self.connection.close()
            except Exception as error:  # noqa: BLE001 - closing must not fail the caller
                log.debug("closing the RabbitMQ connection: %s", describe(error))


def _header_bound(headers: dict[str, str]) -> int:
    """An upper bound of the content header frame's size: the fixed properties (each short
    string at most 256 bytes) and every header as a long string with its name (4 bytes a
    character at most)."""
    return 4_096 + sum(4 * (len(k) + len(v)) + 6 for k, v in headers.items())
