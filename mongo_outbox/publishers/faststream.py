"""The import path ``mongo_outbox.publishers.faststream`` of before brokers got a package each: the
adapter lives in ``mongo_outbox.brokers.faststream.publisher`` (needs the ``faststream`` extra)."""

from mongo_outbox.brokers.faststream.publisher import FastStreamPublisher

__all__ = ["FastStreamPublisher"]
