"""Consumer helpers: run an ``inbox_guard``-ed handler on broker messages and settle them.

Each broker's client is an extra (``mongo-outbox[rabbitmq]``, ``[nats]``, ``[redis]``), imported
only when its helpers are asked for. ``base`` holds what they share, including the
outcome-to-broker table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mongo_outbox.consumers.base import Rejected

if TYPE_CHECKING:
    from mongo_outbox.consumers.nats import consume_nats, handle_nats_message
    from mongo_outbox.consumers.rabbitmq import consume_rabbitmq, handle_rabbitmq_message
    from mongo_outbox.consumers.redis import consume_redis

__all__ = [
    "Rejected",
    "consume_nats",
    "consume_rabbitmq",
    "consume_redis",
    "handle_nats_message",
    "handle_rabbitmq_message",
]


def __getattr__(name: str) -> Any:
    # Import a broker's helpers only when asked for, so its client stays an optional extra.
    if name in ("consume_nats", "handle_nats_message"):
        from mongo_outbox.consumers import nats

        return getattr(nats, name)
    if name in ("consume_rabbitmq", "handle_rabbitmq_message"):
        from mongo_outbox.consumers import rabbitmq

        return getattr(rabbitmq, name)
    if name == "consume_redis":
        from mongo_outbox.consumers.redis import consume_redis

        return consume_redis
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
