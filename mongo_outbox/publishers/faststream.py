"""An import path of ``FastStreamPublisher``, kept from before each broker got a package of its own
(it lives in ``mongo_outbox.brokers.faststream``). Import it from ``mongo_outbox.publishers``."""

from mongo_outbox.brokers.faststream.publisher import FastStreamPublisher

__all__ = ["FastStreamPublisher"]
