"""The import path ``mongo_outbox.publishers.nats`` of before brokers got a package each: the
adapter lives in ``mongo_outbox.brokers.nats.publisher`` (needs the ``nats`` extra)."""

from mongo_outbox.brokers.nats.publisher import (
    MAX_HEADER_BYTES,
    NatsPublisher,
    checked_subject,
    subject_of,
)

__all__ = ["MAX_HEADER_BYTES", "NatsPublisher", "checked_subject", "subject_of"]
