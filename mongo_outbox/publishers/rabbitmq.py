"""An import path of ``RabbitMQPublisher``, kept from before each broker got a package of its own
(it lives in ``mongo_outbox.brokers.rabbitmq``). Import it from ``mongo_outbox.publishers``."""

from mongo_outbox.brokers.rabbitmq.publisher import RabbitMQPublisher

__all__ = ["RabbitMQPublisher"]
