"""Broker adapters. Each broker's client is an extra: ``mongo-outbox[rabbitmq]``, ``[nats]``,
``[redis]``, ``[faststream]`` (with the FastStream broker of your choice).

Each adapter lives with the rest of its broker in ``mongo_outbox.brokers.<name>``; this front
imports it when it is first asked for (``mongo_outbox.brokers.BROKERS`` says where)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mongo_outbox.brokers import resolve
from mongo_outbox.publishers.base import BatchPublisher, Publisher
from mongo_outbox.publishers.memory import MemoryPublisher

if TYPE_CHECKING:
    from mongo_outbox.brokers.faststream.publisher import FastStreamPublisher
    from mongo_outbox.brokers.nats.publisher import NatsPublisher
    from mongo_outbox.brokers.rabbitmq.publisher import RabbitMQPublisher
    from mongo_outbox.brokers.redis.publisher import RedisStreamsPublisher

__all__ = [
    "BatchPublisher",
    "FastStreamPublisher",
    "MemoryPublisher",
    "NatsPublisher",
    "Publisher",
    "RabbitMQPublisher",
    "RedisStreamsPublisher",
]


def __getattr__(name: str) -> Any:
    # Import a broker adapter only when asked for, so its client stays an optional extra.
    try:
        return resolve(name, "publisher")
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
