"""Broker adapters. Each broker's client is an extra: ``mongo-outbox[rabbitmq]``, ``[nats]``,
``[redis]``, ``[faststream]`` (with the FastStream broker of your choice)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mongo_outbox.publishers.base import BatchPublisher, Publisher
from mongo_outbox.publishers.memory import MemoryPublisher

if TYPE_CHECKING:
    from mongo_outbox.publishers.faststream import FastStreamPublisher
    from mongo_outbox.publishers.nats import NatsPublisher
    from mongo_outbox.publishers.rabbitmq import RabbitMQPublisher
    from mongo_outbox.publishers.redis import RedisStreamsPublisher

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
    if name == "FastStreamPublisher":
        from mongo_outbox.publishers.faststream import FastStreamPublisher

        return FastStreamPublisher
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
