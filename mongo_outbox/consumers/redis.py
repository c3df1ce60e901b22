"""The import path ``mongo_outbox.consumers.redis`` of before brokers got a package each: the
adapter lives in ``mongo_outbox.brokers.redis.consumer`` (needs the ``redis`` extra)."""

from mongo_outbox.brokers.redis.consumer import consume_redis, default_consumer_name

__all__ = ["consume_redis", "default_consumer_name"]
