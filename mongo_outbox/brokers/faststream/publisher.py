"""FastStreamPublisher: the relay publishes through a FastStream broker the application already
runs (RabbitMQ, NATS JetStream, Redis streams, Kafka).

What identifies a message, per broker (the event id, which consumers deduplicate on):

=========  ==============================  ============================  =====================
broker     destination (``destination``)   event id travels as           confirmed by
=========  ==============================  ============================  =====================
RabbitMQ   routing key (and ``exchange``)  ``message_id`` property       publisher confirm
NATS       subject, in ``stream``          ``Nats-Msg-Id`` header        the stream's ack
Redis      stream key (XADD)               ``message_id`` header         XADD's reply
Kafka      topic; key = aggregate id       ``message_id`` header         the leader's ack
=========  ==============================  ============================  =====================

FastStream's subscribers read the ``message_id`` header as ``msg.message_id`` on NATS and Redis
(and the property on RabbitMQ); on Kafka ``msg.message_id`` is the offset, so read the header.
Every message also carries ``message_headers`` (event type, aggregate type and id, sequence) and
``correlation_id`` (the event's, else its id).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from mongo_outbox.brokers import BROKERS
from mongo_outbox.brokers._publishing import (
    Naming,
    check_naming,
    client_call,
    closed_error,
    message_headers,
    render,
)
from mongo_outbox.cloudevents import CloudEvents, check_option, message_of
from mongo_outbox.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    InvalidEventError,
    PublishError,
)
from mongo_outbox.events import Event
from mongo_outbox.settings import Duration, check_seconds

try:
    from mongo_outbox.brokers.faststream.errors import classifier
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "FastStreamPublisher needs the faststream extra: pip install 'mongo-outbox[faststream]'"
    ) from error

log = logging.getLogger(__name__)

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

_KINDS = {
    "faststream.rabbit": "RabbitMQ",
    "faststream.nats": "NATS",
    "faststream.redis": "Redis",
    "faststream.kafka": "Kafka",
    "faststream.confluent": "Kafka",
}


# Each protocol binding's prefix of a binary-mode attribute header.
_CE_PREFIXES = {"RabbitMQ": "cloudEvents_", "NATS": "ce-", "Redis": "ce-", "Kafka": "ce_"}


def _kind(broker: object) -> str:
    for klass in type(broker).__mro__:
        for package, kind in _KINDS.items():
            if klass.__module__.startswith(package + "."):
                return kind
    raise ConfigurationError(
        "FastStreamPublisher takes a FastStream RabbitBroker, NatsBroker, RedisBroker or "
        f"KafkaBroker, not {type(broker).__name__}",
        setting="FastStreamPublisher.broker",
    )


class FastStreamPublisher:
    """Publishes each event through a FastStream broker and returns once the broker confirmed it.

    The broker stays the caller's: connect it (``await broker.connect()``, or run it in its
    ``FastStream`` app) before the relay starts, and close it after; ``aclose`` only stops this
    publisher. Until it is connected, or while its server is unreachable, ``publish`` raises
    ``BrokerUnavailableError``, which the relay retries without counting an attempt.

    Parameters:
        broker: a FastStream ``RabbitBroker``, ``NatsBroker``, ``RedisBroker`` or ``KafkaBroker``.
        destination: template or function giving the routing key (RabbitMQ), subject (NATS),
            stream key (Redis) or topic (Kafka); default ``"events.{aggregate_type}.{type}"``.
        exchange: RabbitMQ only: the exchange to publish to (default: the default exchange).
        stream: NATS only, and required there: the JetStream stream the subjects belong to (a
            plain NATS publish is never confirmed).
        timeout: seconds (or a ``timedelta``) to wait for each confirmation.
        cloudevents: publish CloudEvents 1.0 (``mongo_outbox.cloudevents``): binary mode puts
            the attributes in headers under each binding's prefix (Kafka ``ce_``, NATS ``ce-``,
            RabbitMQ the AMQP binding's ``cloudEvents_``, Redis ``ce-``) and the payload in the
            body; structured mode sends one ``application/cloudevents+json`` document.
    """

    def __init__(
        self,
        broker: Any,
        destination: Naming = "events.{aggregate_type}.{type}",
        *,
        exchange: str | None = None,
        stream: str | None = None,
        timeout: Duration = 5.0,
        cloudevents: CloudEvents | None = None,
    ) -> None:
        self.kind = _kind(broker)
        self.cloudevents = check_option(cloudevents, "FastStreamPublisher.cloudevents")
        if exchange is not None and self.kind != "RabbitMQ":
            raise ConfigurationError(
                f"FastStreamPublisher.exchange is for RabbitMQ, not {self.kind}",
                setting="FastStreamPublisher.exchange",
            )
        if (stream is None) == (self.kind == "NATS"):
            raise ConfigurationError(
                "FastStreamPublisher.stream (the JetStream stream) is required for NATS, and "
                f"only for NATS (this broker is {self.kind})",
                setting="FastStreamPublisher.stream",
            )
        self.broker = broker
        self.destination = check_naming(destination, "FastStreamPublisher.destination")
        self.exchange = exchange
        self.stream = stream
        self.timeout = check_seconds(timeout, "FastStreamPublisher.timeout")
        self.closed = False
        self._classify = classifier(self.kind)

    async def publish(self, event: Event) -> None:
        if self.closed:
            raise closed_error(self, event)
        if self.kind == "NATS":
            from mongo_outbox.brokers.nats.publisher import subject_of

            destination = subject_of(self.destination, event)  # no wildcard, no empty token
        else:
            destination = render(self.destination, event)
        if not destination:
            raise InvalidEventError(f"empty destination for event {event.id}", event_id=event.id)
        headers, content_type, body = message_of(
            event, self.cloudevents, _CE_PREFIXES[self.kind], message_headers(event)
        )
        # Kafka's binding (and NATS's, read case-insensitively) put datacontenttype here.
        headers["content-type"] = content_type
        options: dict[str, Any] = {"correlation_id": event.correlation_id or event.id}
        if self.kind == "RabbitMQ":
            options.update(
                routing_key=destination,
                exchange=self.exchange,
                message_id=event.id,
                content_type=content_type,
                message_type=event.type,
                # AMQP's timestamp is unsigned (pamqp fails on an earlier one); the body
                # carries occurred_at whole anyway.
                timestamp=event.occurred_at if event.occurred_at >= _EPOCH else None,
                persist=True,
                mandatory=True,
                timeout=self.timeout,
            )
            del headers["content-type"]
        elif self.kind == "NATS":
            headers["Nats-Msg-Id"] = event.id  # JetStream drops a republished copy on this
            headers["message_id"] = event.id
            options.update(subject=destination, stream=self.stream, timeout=self.timeout)
        elif self.kind == "Redis":
            headers["message_id"] = event.id
            options.update(stream=destination)
        else:
            headers["message_id"] = event.id
            key = None if event.aggregate_id is None else str(event.aggregate_id).encode()
            options.update(topic=destination, key=key)
        options["headers"] = headers
        try:
            result = await client_call(
                self.broker.publish(body, **options),
                self.timeout,
                lambda reason: self._failed(event, reason),
            )
        except (PublishError, InvalidEventError):
            raise
        except Exception as error:
            classified = self._classify(error, event, destination)
            if classified is None:
                raise
            raise classified from error
        if self.kind == "RabbitMQ":
            _check_rabbitmq(result, event, destination)

    def _failed(self, event: Event, reason: str) -> BrokerUnavailableError:
        if self.closed:
            return closed_error(self, event)
        return BrokerUnavailableError(f"{self.kind}: {reason}", event_id=event.id)

    async def publish_many(self, events: Sequence[Event]) -> list[BaseException | None]:
        # Every message goes out before any confirmation is awaited.
        results = await asyncio.gather(*map(self.publish, events), return_exceptions=True)
        return [result if isinstance(result, BaseException) else None for result in results]

    async def aclose(self) -> None:
        """Stop publishing; the broker is the caller's to close."""
        self.closed = True


def _check_rabbitmq(result: object, event: Event, destination: str) -> None:
    """Raise unless ``result`` is the broker's ack: FastStream's channels have publisher
    confirms on and on_return_raises off, so a message no queue is bound for comes back as the
    result instead of an ack, and is classified as ``RabbitMQPublisher`` classifies it."""
    errors = BROKERS["rabbitmq"].module("errors")
    if errors.acked(result):
        return
    answer = errors.answer_error(result)
    if answer is not None:
        raise errors.classify(answer, event, destination) from answer
    raise PublishError(
        f"RabbitMQ did not confirm event {event.id} ({type(result).__name__}): is the "
        "channel's publisher_confirms off?",
        event_id=event.id,
    )
