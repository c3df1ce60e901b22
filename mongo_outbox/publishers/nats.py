"""An import path of ``NatsPublisher``, kept from before each broker got a package of its own
(it lives in ``mongo_outbox.brokers.nats``). Import it from ``mongo_outbox.publishers``."""

from mongo_outbox.brokers.nats.publisher import NatsPublisher

__all__ = ["NatsPublisher"]
