"""RabbitMQPublisher: RabbitMQ through aio-pika, with publisher confirms and AMQP ``message_id``."""

from __future__ import annotations

from mongo_outbox.errors import InvalidEventError, PublishError
from mongo_outbox.events import Event
from mongo_outbox.publishers.base import (
    Naming,
    closed_error,
    message_headers,
    render,
    unavailable_error,
)

try:
    import aio_pika
    import aiormq
    from aio_pika.abc import AbstractExchange, AbstractRobustConnection
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "RabbitMQPublisher needs the rabbitmq extra: pip install 'mongo-outbox[rabbitmq]'"
    ) from error

# The connection is down, its channel is closed while connect_robust reopens it, or no queue is
# bound for the message yet (returned as unroutable, aiormq's PublishError).
_UNAVAILABLE = (
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.PublishError,
)


class RabbitMQPublisher:
    """Publishes each event as a persistent message and waits for the broker's confirm.

    The exchange's channel must have publisher confirms on (``connect`` does that, with
    ``on_return_raises``). Messages are ``mandatory``: one that no queue is bound for comes
    back as an error and is retried, rather than confirmed and dropped. Connection failures and
    unroutable messages raise ``BrokerUnavailableError``: the relay waits for the broker, and
    for a queue, without parking anything.

    Parameters:
        exchange: an aio-pika exchange on a channel with publisher confirms; its connection
            stays the caller's.
        routing_key: template or function giving the routing key; default ``"{type}"``.
        timeout: seconds to wait for each confirm (and for the connection, in ``connect``).
    """

    def __init__(
        self,
        exchange: AbstractExchange,
        *,
        routing_key: Naming = "{type}",
        timeout: float = 5.0,
    ) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.timeout = timeout
        self.closed = False
        self.connection: AbstractRobustConnection | None = None
        """The connection ``connect`` opened, which ``aclose`` closes; else ``None``."""

    @classmethod
    async def connect(
        cls,
        url: str = "amqp://guest:guest@127.0.0.1/",
        *,
        exchange: str = "events",
        routing_key: Naming = "{type}",
        timeout: float = 5.0,
    ) -> RabbitMQPublisher:
        """Open a connection of its own and declare ``exchange`` as a durable topic exchange."""
        connection = await aio_pika.connect_robust(url, timeout=timeout)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            declared = await channel.declare_exchange(
                exchange, aio_pika.ExchangeType.TOPIC, durable=True, timeout=timeout
            )
        except BaseException:
            await connection.close()
            raise
        publisher = cls(declared, routing_key=routing_key, timeout=timeout)
        publisher.connection = connection
        return publisher

    def routing_key_for(self, event: Event) -> str:
        key = render(self.routing_key, event)
        if len(key.encode()) > 255:  # an AMQP short string
            raise InvalidEventError(f"routing key {key[:40]!r}... is too long", event_id=event.id)
        return key

    async def publish(self, event: Event) -> None:
        if self.closed:
            raise closed_error(self, event)
        message = aio_pika.Message(
            event.model_dump_json().encode(),
            message_id=event.id,
            type=event.type,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            timestamp=event.occurred_at,
            correlation_id=event.correlation_id,
            headers=dict(message_headers(event)),
        )
        key = self.routing_key_for(event)
        try:
            confirm = await self.exchange.publish(
                message, routing_key=key, mandatory=True, timeout=self.timeout
            )
        except _UNAVAILABLE as error:
            # Returned unroutable (NO_ROUTE): the broker is up, no queue is bound for the key.
            missing = isinstance(error, aiormq.exceptions.PublishError)
            raise unavailable_error(
                "RabbitMQ", error, event, destination=key if missing else None
            ) from error
        # Without confirms the result is None, and without on_return_raises a returned
        # message comes back as the result: neither means the broker has the message.
        if not isinstance(confirm, aiormq.spec.Basic.Ack):
            raise PublishError(
                f"RabbitMQ did not confirm event {event.id}: {confirm!r}", event_id=event.id
            )

    async def aclose(self) -> None:
        self.closed = True
        if self.connection is not None and not self.connection.is_closed:
            await self.connection.close()
