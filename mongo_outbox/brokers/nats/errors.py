"""What a NATS client's error means to the relay, on every path to NATS: ``NatsPublisher`` and
FastStream's ``NatsBroker`` (``FastStreamPublisher``) both classify through ``classify``."""

from __future__ import annotations

import asyncio

from mongo_outbox.brokers._publishing import full_error, unavailable_error
from mongo_outbox.errors import PublishError
from mongo_outbox.events import Event

try:
    import nats.errors
    import nats.js.errors
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("NATS needs the nats extra: pip install 'mongo-outbox[nats]'") from error

# No ack in time, no server to talk to, or no stream answering for the subject (also while
# JetStream restarts).
UNAVAILABLE = (
    asyncio.TimeoutError,  # nats' own TimeoutError; not the builtin one before Python 3.11
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
    nats.errors.NoServersError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
# The server answers, but no stream takes the subject: the destination is missing.
_NO_DESTINATION = (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError)

# JetStream's answers for want of room (nats-server's errors.json), each retried like an outage.
_ACCOUNT_RESOURCES_EXCEEDED = 10002  # the account's JetStream storage limit is reached
_INSUFFICIENT_RESOURCES = 10023  # the server's JetStream storage limit is reached
_STREAM_STORE_FAILED = 10077  # storing failed; its description says why, see _STREAM_FULL
_STREAM_FULL = frozenset(
    {
        # A stream at a limit with the discard-new policy (nats-server store.go: ErrMaxMsgs,
        # ErrMaxBytes, ErrMaxMsgsPerSubject). 10077 also carries other failures, such as
        # "message too large", which are not for want of room.
        "maximum messages exceeded",
        "maximum bytes exceeded",
        "maximum messages per subject exceeded",
    }
)


def _full(error: nats.js.errors.APIError) -> bool:
    if error.err_code in (_ACCOUNT_RESOURCES_EXCEEDED, _INSUFFICIENT_RESOURCES):
        return True
    return error.err_code == _STREAM_STORE_FAILED and error.description in _STREAM_FULL


def classify(error: BaseException, event: Event, subject: str) -> PublishError | None:
    """What the relay makes of a NATS client's error: ``BrokerFullError`` when JetStream has
    no room (a stream at its limits with discard-new, or the account's or server's storage
    full), ``BrokerUnavailableError`` for an outage (with ``subject`` as its ``destination``
    when the server answers but no stream takes it), None when the stream refused this message
    as it is (too large, a bad header...): an attempt that counts."""
    if isinstance(error, nats.js.errors.APIError) and _full(error):
        return full_error("NATS", error, event)
    if isinstance(error, UNAVAILABLE):
        missing = isinstance(error, _NO_DESTINATION)
        return unavailable_error("NATS", error, event, destination=subject if missing else None)
    if isinstance(error, OSError):  # the socket under the connection
        return unavailable_error("NATS", error, event)
    return None
