"""Broker adapters. Each broker's client is an extra: ``mongo-outbox[rabbitmq]``, ``[nats]``,
``[redis]``, ``[faststream]`` (with the FastStream broker of your choice).

Each adapter lives with the rest of its broker in ``mongo_outbox.brokers.<name>``; this front
imports it when it is first asked for (``mongo_outbox.brokers.BROKERS`` says where)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mongo_outbox.brokers import front
from mongo_outbox.brokers._publishing import (
    BatchPublisher,
    Publisher,
    WavePublisher,
    redact_url,
    url_secrets,
)

if TYPE_CHECKING:
    from mongo_outbox.brokers.faststream.publisher import FastStreamPublisher
    from mongo_outbox.brokers.memory.publisher import MemoryPublisher
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
    "WavePublisher",
    "redact_url",
    "url_secrets",
]


__getattr__ = front(__name__, "publisher")
