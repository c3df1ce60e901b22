"""What a Redis client's error means to the relay, on every path to Redis:
``RedisStreamsPublisher`` and FastStream's ``RedisBroker`` (``FastStreamPublisher``) both
classify through ``classify`` (docs/redis.md has the table)."""

from __future__ import annotations

import asyncio

from mongo_outbox.brokers._publishing import full_error, unavailable_error
from mongo_outbox.errors import PublishError
from mongo_outbox.events import Event

try:
    import redis.exceptions
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("Redis needs the redis extra: pip install 'mongo-outbox[redis]'") from error

# Not the message's fault, each retried without counting an attempt: no connection (refused,
# dropped, timed out, still loading its data set, authentication refused), a replica that
# cannot be written to, a cluster or master that is down, an ACL that forbids the command
# (an operator fixes it), or a server that cannot persist (MISCONF, answered as a plain
# ResponseError, see _OUTAGE_PREFIXES).
_UNAVAILABLE = (
    asyncio.TimeoutError,  # not the builtin TimeoutError before Python 3.11
    OSError,  # the socket under the client, when the client does not wrap its error
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.NoPermissionError,
)
# Error prefixes of a server that answered but cannot take writes for now.
_OUTAGE_PREFIXES = ("MISCONF", "LOADING", "MASTERDOWN", "TRYAGAIN", "NOREPLICAS")
_OUT_OF_MEMORY = "OOM"  # maxmemory reached with the noeviction policy
_WRONG_TYPE = "WRONGTYPE"  # the key holds something other than a stream


def is_outage(error: BaseException) -> bool:
    """Whether Redis is out of reach or cannot serve for now: retried, never the message's
    fault (a failover's read-only replica, a master down, a server still loading)."""
    return isinstance(error, _UNAVAILABLE) or str(error).startswith(_OUTAGE_PREFIXES)


def classify(error: BaseException, event: Event, stream: str) -> PublishError | None:
    """What the relay makes of a Redis client's error: ``BrokerFullError`` when Redis is out of
    memory, ``BrokerUnavailableError`` for an outage (a failover too) or a key of another type
    under ``stream`` (with ``stream`` as its ``destination``), None when the error is the
    event's own (it counts an attempt)."""
    text = str(error)
    if isinstance(error, redis.exceptions.OutOfMemoryError) or text.startswith(_OUT_OF_MEMORY):
        return full_error("Redis", error, event)
    if is_outage(error):
        return unavailable_error("Redis", error, event)
    if text.startswith(_WRONG_TYPE):
        return unavailable_error("Redis", error, event, destination=stream)
    return None
