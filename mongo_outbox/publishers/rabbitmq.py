"""RabbitMQPublisher: RabbitMQ through aio-pika, with publisher confirms and AMQP ``message_id``."""

from __future__ import annotations

from typing import Any

from mongo_outbox.events import Event
from mongo_outbox.publishers.base import Naming, message_headers, render

try:
    import aio_pika
    from aio_pika.abc import AbstractExchange
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "RabbitMQPublisher needs the rabbitmq extra: pip install 'mongo-outbox[rabbitmq]'"
    ) from error


class RabbitMQPublisher:
    """Publishes each event as a persistent message and waits for the broker's confirm.

    The exchange's channel must have publisher confirms and ``on_return_raises`` on (``connect``
    does that). Messages are ``mandatory``: one that no queue is bound for comes back as an
    error and is retried, rather than confirmed and dropped.

    Parameters:
        exchange: an aio-pika exchange on a channel with publisher confirms.
        routing_key: template or function giving the routing key; default ``"{type}"``.
        timeout: seconds to wait for the connection (``connect``). A publish waits for its
            confirm without a timeout of its own: the relay bounds it with ``publish_timeout``.
    """

    def __init__(
        self,
        exchange: AbstractExchange,
        *,
        routing_key: Naming = "{type}",
        timeout: float = 5.0,
        connection: Any = None,
    ) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.timeout = timeout
        self._connection = connection

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
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        declared = await channel.declare_exchange(
            exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        return cls(declared, routing_key=routing_key, timeout=timeout, connection=connection)

    async def publish(self, event: Event) -> None:
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
        await self.exchange.publish(
            message,
            routing_key=render(self.routing_key, event),
            mandatory=True,
        )

    async def aclose(self) -> None:
        if self._connection is not None and not self._connection.is_closed:
            await self._connection.close()
