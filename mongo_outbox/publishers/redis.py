"""The import path ``mongo_outbox.publishers.redis`` of before brokers got a package each: the
adapter lives in ``mongo_outbox.brokers.redis.publisher`` (needs the ``redis`` extra)."""

from mongo_outbox.brokers.redis.publisher import RedisStreamsPublisher

__all__ = ["RedisStreamsPublisher"]
