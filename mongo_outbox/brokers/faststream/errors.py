"""What a FastStream broker's error means to the relay. FastStream raises its client's own
errors (aiormq's, nats-py's, redis-py's), so each is classified by the one classification of
the broker underneath (``brokers.<name>.errors.classify``), the one its direct publisher uses;
what is left is FastStream's own (a broker not connected) and Kafka's, which only FastStream
reaches."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mongo_outbox.brokers import BROKERS
from mongo_outbox.brokers._publishing import unavailable_error
from mongo_outbox.errors import InvalidEventError, PublishError, describe
from mongo_outbox.events import Event

try:
    from faststream import exceptions as faststream_errors
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "FastStream needs the faststream extra: pip install 'mongo-outbox[faststream]'"
    ) from error

Classifier = Callable[[BaseException, Event, str], PublishError | InvalidEventError | None]

# What FastStream raises when publishing on a broker that is not connected.
_NOT_CONNECTED: type[Exception] = getattr(
    faststream_errors, "IncorrectState", faststream_errors.FastStreamException
)

# The package in ``BROKERS`` of each kind of FastStream broker that has one.
_PACKAGES = {"RabbitMQ": "rabbitmq", "NATS": "nats", "Redis": "redis"}


def classifier(kind: str) -> Classifier:
    """The function telling, for a FastStream broker of ``kind`` (``"RabbitMQ"``, ``"NATS"``,
    ``"Redis"``, ``"Kafka"``), an outage from the message's fault: None for the message's own
    failure, an attempt that counts. Imports that broker's client (FastStream's broker needs
    it already)."""
    package = _PACKAGES.get(kind)
    if package is None:
        return _kafka
    classify: Callable[[BaseException, Event, str], PublishError | None]
    classify = BROKERS[package].module("errors").classify

    def classified(error: BaseException, event: Event, destination: str) -> PublishError | None:
        return classify(error, event, destination) or _not_connected(kind, error, event)

    return classified


def _not_connected(kind: str, error: BaseException, event: Event) -> PublishError | None:
    # Not connected yet (or any more): FastStream's own state error; the transport's errors.
    if isinstance(error, (_NOT_CONNECTED, OSError, asyncio.TimeoutError)):
        return unavailable_error(kind, error, event)
    return None


def _kafka(
    error: BaseException, event: Event, destination: str
) -> PublishError | InvalidEventError | None:
    try:
        from aiokafka import errors
    except ImportError:  # confluent's broker: its transport errors are the common ones
        return _not_connected("Kafka", error, event)
    if isinstance(error, errors.MessageSizeTooLargeError):
        return InvalidEventError(f"Kafka: {describe(error)}", event_id=event.id)
    if isinstance(error, errors.UnknownTopicOrPartitionError):
        return unavailable_error("Kafka", error, event, destination=destination)
    if isinstance(error, errors.KafkaError) and getattr(error, "retriable", False):
        return unavailable_error("Kafka", error, event)
    if isinstance(error, (errors.KafkaConnectionError, errors.KafkaTimeoutError)):
        return unavailable_error("Kafka", error, event)
    return _not_connected("Kafka", error, event)
