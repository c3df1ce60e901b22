"""Reading a RabbitMQ queue's depth in a test."""

from __future__ import annotations

from typing import Any


async def ready_count(channel: Any, name: str) -> int:
    """Messages ready in queue ``name`` (a passive declare: the queue must exist, or the broker
    closes the channel). Asked through aiormq: an aio-pika robust channel answers a passive
    declare of a queue it knows from its cache, with the count of that time."""
    underlay = await channel.get_underlay_channel()
    return int((await underlay.queue_declare(name, passive=True)).message_count)
