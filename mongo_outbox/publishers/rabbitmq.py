"""The import path ``mongo_outbox.publishers.rabbitmq`` of before brokers got a package each: the
adapter lives in ``mongo_outbox.brokers.rabbitmq.publisher`` (needs the ``rabbitmq`` extra)."""

from mongo_outbox.brokers.rabbitmq.publisher import RabbitMQPublisher, routing_key_of

__all__ = ["RabbitMQPublisher", "routing_key_of"]
