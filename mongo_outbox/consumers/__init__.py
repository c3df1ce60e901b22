"""Consumer helpers: run an ``inbox_guard``-ed handler on broker messages and settle them.

Each broker's client is an extra (``mongo-outbox[rabbitmq]``, ``[nats]``, ``[redis]``), imported
only when its helpers are asked for: they live with the rest of their broker in
``mongo_outbox.brokers.<name>.consumer`` (``mongo_outbox.brokers.BROKERS`` says where), and
what they share, including the outcome-to-broker table, in ``mongo_outbox.brokers._consuming``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mongo_outbox.brokers import front
from mongo_outbox.brokers._consuming import Rejected

if TYPE_CHECKING:
    from mongo_outbox.brokers.nats.consumer import consume_nats, handle_nats_message
    from mongo_outbox.brokers.rabbitmq.consumer import consume_rabbitmq, handle_rabbitmq_message
    from mongo_outbox.brokers.redis.consumer import consume_redis

__all__ = [
    "Rejected",
    "consume_nats",
    "consume_rabbitmq",
    "consume_redis",
    "handle_nats_message",
    "handle_rabbitmq_message",
]


__getattr__ = front(__name__, "consumer")
