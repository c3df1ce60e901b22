"""The import path ``mongo_outbox.consumers.nats`` of before brokers got a package each: the
adapter lives in ``mongo_outbox.brokers.nats.consumer`` (needs the ``nats`` extra)."""

from mongo_outbox.brokers.nats.consumer import consume_nats, handle_nats_message

__all__ = ["consume_nats", "handle_nats_message"]
