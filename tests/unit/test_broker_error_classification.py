"""Each broker has one classification of its client's errors, and every path to it uses it: the
broker's own publisher and ``FastStreamPublisher`` on FastStream's broker for it give the relay
the same verdict for the same error (an outage, a full broker, or the message's own failure).

Each path is its publisher's own conversion, on a publisher that never connects: the direct
publishers get stand-ins for a client they never call, FastStream's publisher a real broker
object that is not connected."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from mongo_outbox.errors import unavailable
from mongo_outbox.events import Event

EVENT = Event(type="order.placed")
DESTINATION = "orders.placed"
Path = Callable[[BaseException], BaseException | None]


def verdict(error: BaseException, raised: BaseException | None) -> tuple[Any, ...]:
    """What the relay acts on: the message's own failure (the client's error as it came), or
    the error it was turned into, with its text and destination."""
    if raised is None or raised is error:
        return ("the message's own", type(error))
    assert unavailable(raised), raised
    return (type(raised), str(raised), getattr(raised, "destination", None))


def through_faststream(broker: Any, **options: Any) -> Path:
    from mongo_outbox.publishers import FastStreamPublisher

    publisher = FastStreamPublisher(broker, DESTINATION, **options)
    return lambda error: publisher._classify(error, EVENT, DESTINATION)


def nats_errors() -> list[BaseException]:
    import nats.errors
    import nats.js.errors

    return [
        nats.js.errors.APIError(code=500, err_code=10077, description="maximum bytes exceeded"),
        nats.js.errors.APIError(code=500, err_code=10023, description="insufficient resources"),
        nats.js.errors.APIError(code=500, err_code=10002, description="resources exceeded"),
        nats.errors.NoRespondersError(),
        nats.js.errors.NoStreamResponseError(),
        nats.js.errors.ServiceUnavailableError(code=503, description="unavailable"),
        nats.errors.ConnectionClosedError(),
        nats.errors.ConnectionReconnectingError(),
        nats.errors.OutboundBufferLimitError(),
        nats.errors.TimeoutError(),
        ConnectionResetError("reset by peer"),
        # The stream refused this message as it is: an attempt on both paths.
        nats.js.errors.APIError(code=500, err_code=10077, description="message too large"),
        nats.js.errors.BadRequestError(code=400, description="bad header"),
    ]


def test_nats_errors_are_classified_alike_by_nats_publisher_and_faststream() -> None:
    from faststream.nats import NatsBroker

    from mongo_outbox.publishers import NatsPublisher

    direct = NatsPublisher(js=object())  # type: ignore[arg-type] - a stand-in, never called
    faststream = through_faststream(NatsBroker(), stream="events")
    for error in nats_errors():
        mine = verdict(error, direct._result(EVENT, error, DESTINATION))
        assert verdict(error, faststream(error)) == mine, error
    assert verdict(nats_errors()[0], faststream(nats_errors()[0]))[0].__name__ == "BrokerFullError"


def rabbitmq_answers() -> list[tuple[Any, BaseException]]:
    """A broker's answer other than an ack, as ``RabbitMQPublisher`` gets it (a confirm
    outcome) and as FastStream raises it (aiormq's error)."""
    import aiormq
    from aiormq.abc import DeliveredMessage
    from pamqp import commands as spec
    from pamqp.header import ContentHeader

    returned = DeliveredMessage(
        delivery=spec.Basic.Return(
            reply_code=312, reply_text="NO_ROUTE", exchange="events", routing_key=DESTINATION
        ),
        header=ContentHeader(),
        body=b"{}",
        channel=None,  # type: ignore[arg-type] - not read
    )
    nack = spec.Basic.Nack(delivery_tag=1)
    return [
        (returned, aiormq.exceptions.PublishError(returned, returned.delivery)),
        (nack, aiormq.exceptions.DeliveryError(None, nack)),
    ]


def rabbitmq_failures() -> list[BaseException]:
    import aiormq

    return [
        aiormq.exceptions.ChannelNotFoundEntity("NOT_FOUND - no exchange 'events'"),
        aiormq.exceptions.ChannelAccessRefused("ACCESS_REFUSED"),
        aiormq.exceptions.ChannelClosed("channel closed"),
        aiormq.exceptions.ConnectionClosed(320, "CONNECTION_FORCED"),
        aiormq.exceptions.AMQPConnectionError("connection lost"),
        aiormq.exceptions.ChannelInvalidStateError("the channel is closed"),
        ConnectionResetError("reset by peer"),
        asyncio.TimeoutError(),
        # The broker closed the channel over what was sent: an attempt on both paths.
        aiormq.exceptions.ChannelPreconditionFailed("PRECONDITION_FAILED - message too large"),
        aiormq.exceptions.ChannelLockedResource("RESOURCE_LOCKED"),
    ]


def test_rabbitmq_errors_are_classified_alike_by_rabbitmq_publisher_and_faststream() -> None:
    from faststream.rabbit import RabbitBroker

    from mongo_outbox.brokers.rabbitmq._confirms import PENDING
    from mongo_outbox.publishers import RabbitMQPublisher

    direct = RabbitMQPublisher(object())  # type: ignore[arg-type] - a stand-in, never called
    faststream = through_faststream(RabbitBroker())
    kinds = []
    for outcome, error in rabbitmq_answers():
        raised = direct._result(EVENT, outcome, None, DESTINATION)
        assert raised is not None and raised.__cause__ is not None
        mine = verdict(raised.__cause__, raised)
        assert verdict(error, faststream(error)) == mine, error
        kinds.append(mine)
    assert [kind[0].__name__ for kind in kinds] == ["BrokerUnavailableError", "BrokerFullError"]
    assert kinds[0][2] == DESTINATION  # returned: no queue is bound for this routing key
    for error in rabbitmq_failures():
        mine = verdict(error, direct._result(EVENT, PENDING, error, DESTINATION))
        assert verdict(error, faststream(error)) == mine, error


def redis_errors() -> list[BaseException]:
    from redis import exceptions

    return [
        exceptions.ReadOnlyError("You can't write against a read only replica."),
        exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"),
        exceptions.NoPermissionError("NOPERM this user has no permissions"),
        exceptions.BusyLoadingError("LOADING Redis is loading the dataset in memory"),
        exceptions.OutOfMemoryError("OOM command not allowed"),
        *(
            exceptions.ResponseError(f"{prefix} something")
            for prefix in ("MISCONF", "LOADING", "MASTERDOWN", "TRYAGAIN", "NOREPLICAS")
        ),
        exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"),
        exceptions.ConnectionError("Connection refused"),
        exceptions.TimeoutError("Timeout reading from socket"),
        ConnectionResetError("reset by peer"),
        # The event's own failure: an attempt on both paths.
        exceptions.ResponseError("ERR syntax error"),
        exceptions.DataError("Invalid input of type: 'dict'"),
    ]


def test_redis_errors_are_classified_alike_by_redis_publisher_and_faststream() -> None:
    import redis.asyncio
    from faststream.redis import RedisBroker

    from mongo_outbox.publishers import RedisStreamsPublisher

    direct = RedisStreamsPublisher(redis.asyncio.Redis())  # never connects: never called
    faststream = through_faststream(RedisBroker())
    for error in redis_errors():
        mine = verdict(error, direct._classify(EVENT, error, DESTINATION))
        assert verdict(error, faststream(error)) == mine, error
