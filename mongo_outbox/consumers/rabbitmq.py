"""The import path ``mongo_outbox.consumers.rabbitmq`` of before brokers got a package each: the
adapter lives in ``mongo_outbox.brokers.rabbitmq.consumer`` (needs the ``rabbitmq`` extra)."""

from mongo_outbox.brokers.rabbitmq.consumer import consume_rabbitmq, handle_rabbitmq_message

__all__ = ["consume_rabbitmq", "handle_rabbitmq_message"]
