"""Broker adapters. Each broker's client is an extra: ``mongo-outbox[rabbitmq]``, ``[nats]``,
``[redis]``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mongo_outbox.publishers.base import BatchPublisher, Publisher
from mongo_outbox.publishers.memory import MemoryPublisher

if TYPE_CHECKING:
    from mongo_outbox.publishers.nats import NatsPublisher
    from mongo_outbox.publishers.rabbitmq import RabbitMQPublisher
    from mongo_outbox.publishers.redis import RedisStreamsPublisher

__all__ = [
    "BatchPublisher",
    "MemoryPublisher",
    "NatsPublisher",
    "Publisher",
    "RabbitMQPublisher",
    "RedisStreamsPublisher",
]


def __getattr__(name: str) -> Any:
    # Import a broker adapter only when asked for, so its client stays an optional extra.
    if name == "NatsPublisher":
        from mongo_outbox.publishers.nats import NatsPublisher

        return NatsPublisher
    if name == "RabbitMQPublisher":
        from mongo_outbox.publishers.rabbitmq import RabbitMQPublisher

        return RabbitMQPublisher
    if name == "RedisStreamsPublisher":
        from mongo_outbox.publishers.redis import RedisStreamsPublisher

        return RedisStreamsPublisher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
