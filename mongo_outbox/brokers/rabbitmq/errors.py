"""What a RabbitMQ client's error means to the relay, on every path to RabbitMQ:
``RabbitMQPublisher`` and FastStream's ``RabbitBroker`` (``FastStreamPublisher``) both classify
through ``classify``, and turn a broker's answer other than an ack into the client's error
first (``answer_error``)."""

from __future__ import annotations

import asyncio

from mongo_outbox.brokers._publishing import full_error, unavailable_error
from mongo_outbox.errors import PublishError
from mongo_outbox.events import Event

try:
    import aiormq
    from pamqp import commands as spec
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "RabbitMQ needs the rabbitmq extra: pip install 'mongo-outbox[rabbitmq]'"
    ) from error

# The only channel errors that are the message's fault: the broker closed the channel over what
# was sent (PRECONDITION_FAILED: over its max_message_size, say; RESOURCE_LOCKED).
REFUSED = (
    aiormq.exceptions.ChannelPreconditionFailed,
    aiormq.exceptions.ChannelLockedResource,
)
# Not the message's fault, each retried without counting an attempt: the connection down, the
# channel closed (by a drop, or by the broker because the exchange does not exist, 404
# NOT_FOUND, or may not be written to, 403 ACCESS_REFUSED, which an operator fixes), no answer
# in time.
_UNAVAILABLE = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    OSError,
    asyncio.TimeoutError,
)


def acked(answer: object) -> bool:
    return isinstance(answer, spec.Basic.Ack)


def answer_error(answer: object) -> aiormq.exceptions.DeliveryError | None:
    """A broker's answer to a confirmed publish as the error aiormq raises for it: a message
    returned unroutable (``mandatory``: no queue is bound for its key) or a nack; None for any
    other answer."""
    if isinstance(answer, aiormq.abc.DeliveredMessage) and isinstance(
        answer.delivery, spec.Basic.Return
    ):
        return aiormq.exceptions.PublishError(answer, answer.delivery)
    if isinstance(answer, spec.Basic.Nack):
        return aiormq.exceptions.DeliveryError(None, answer)
    return None


def classify(error: BaseException, event: Event, routing_key: str) -> PublishError | None:
    """What the relay makes of a RabbitMQ client's error: ``BrokerUnavailableError`` with
    ``routing_key`` as its ``destination`` for a message returned unroutable (the broker is up,
    no queue is bound for the key), ``BrokerFullError`` for a nack (a queue at its
    ``x-max-length`` with reject-publish, or no storage), ``BrokerUnavailableError`` for an
    outage, None when the error is the message's own (``REFUSED``, or not the client's):
    an attempt that counts."""
    if isinstance(error, aiormq.exceptions.PublishError):
        return unavailable_error("RabbitMQ", error, event, destination=routing_key)
    if isinstance(error, aiormq.exceptions.DeliveryError):
        return full_error("RabbitMQ", error, event)
    if isinstance(error, REFUSED):
        return None
    if isinstance(error, _UNAVAILABLE):
        return unavailable_error("RabbitMQ", error, event)
    return None
