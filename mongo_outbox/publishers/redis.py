"""The import path ``mongo_outbox.publishers.redis`` of before brokers got a package each: the
adapter lives in ``mongo_outbox.brokers.redis.publisher`` (needs the ``redis`` extra)."""

from mongo_outbox.brokers.redis.errors import classify
from mongo_outbox.brokers.redis.publisher import (
    DEFAULT_MAXLEN,
    ENTRY_FIELDS,
    RedisStreamsPublisher,
    entry_of,
    stream_of,
)

__all__ = [
    "DEFAULT_MAXLEN",
    "ENTRY_FIELDS",
    "RedisStreamsPublisher",
    "classify",
    "entry_of",
    "stream_of",
]
