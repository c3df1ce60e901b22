"""An import path of ``RedisStreamsPublisher``, kept from before each broker got a package
of its own (it lives in ``mongo_outbox.brokers.redis``). Import it from
``mongo_outbox.publishers``."""

from mongo_outbox.brokers.redis.publisher import RedisStreamsPublisher

__all__ = ["RedisStreamsPublisher"]
