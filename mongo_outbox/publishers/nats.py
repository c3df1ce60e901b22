"""NatsPublisher: NATS JetStream through nats-py, deduplicated by the broker on ``Nats-Msg-Id``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from mongo_outbox.errors import InvalidEventError
from mongo_outbox.events import Event
from mongo_outbox.publishers.base import (
    Naming,
    closed_error,
    message_headers,
    render,
    unavailable_error,
)

try:
    import nats
    import nats.errors
    import nats.js.errors
    from nats.aio.client import Client
    from nats.js import JetStreamContext
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "NatsPublisher needs the nats extra: pip install 'mongo-outbox[nats]'"
    ) from error

log = logging.getLogger(__name__)

# No server to talk to, or no stream answering for the subject (also while JetStream restarts).
_UNAVAILABLE = (
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


_NO_DESTINATION = (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError)


class NatsPublisher:
    """Publishes each event to a JetStream subject and waits for the stream's ack.

    The event id travels as ``Nats-Msg-Id``, so JetStream drops a republished event that falls
    within the stream's duplicate window (the ack then says ``duplicate``, and that counts as
    published). A subject must be bound to a stream, or the publish fails and the relay
    retries it.

    Parameters:
        js: a ``JetStreamContext`` (``nc.jetstream()``); its connection stays the caller's.
        subject: template or function giving the subject; default
            ``"events.{aggregate_type}.{type}"``.
        timeout: seconds to wait for each ack.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        subject: Naming = "events.{aggregate_type}.{type}",
        timeout: float = 5.0,
    ) -> None:
        self.js = js
        self.subject = subject
        self.timeout = timeout
        self.closed = False
        self.connection: Client | None = None
        """The connection ``connect`` opened, which ``aclose`` closes; else ``None``."""

    @classmethod
    async def connect(
        cls,
        url: str = "nats://127.0.0.1:4222",
        *,
        subject: Naming = "events.{aggregate_type}.{type}",
        timeout: float = 5.0,
    ) -> NatsPublisher:
        """Open a connection of its own, which ``aclose`` drains and closes.

        Once connected it reconnects for as long as it takes; the first connection must
        succeed within ``2 * timeout`` or ``ConnectionError`` is raised.
        """

        async def log_error(error: Exception) -> None:
            log.warning("NATS connection to %s: %s", url, error)

        # nats-py retries a refused first connection forever when reconnects are unlimited.
        try:
            nc = await asyncio.wait_for(
                nats.connect(
                    url, connect_timeout=timeout, max_reconnect_attempts=-1, error_cb=log_error
                ),
                2 * timeout,
            )
        except asyncio.TimeoutError as error:
            raise ConnectionError(f"NATS at {url} did not answer within {2 * timeout}s") from error
        publisher = cls(nc.jetstream(), subject=subject, timeout=timeout)
        publisher.connection = nc
        return publisher

    def subject_for(self, event: Event) -> str:
        subject = render(self.subject, event)
        # Wildcards and empty tokens are not publishable; whitespace would split the protocol line.
        if any(
            not token or "*" in token or ">" in token or any(c.isspace() for c in token)
            for token in subject.split(".")
        ):
            raise InvalidEventError(f"{subject!r} is not a valid NATS subject", event_id=event.id)
        return subject

    async def publish(self, event: Event) -> None:
        if self.closed:
            raise closed_error(self, event)
        headers = message_headers(event)
        headers["Nats-Msg-Id"] = event.id
        headers["Content-Type"] = "application/json"
        # js.publish rather than publish_async: nats-py 2.16 leaves a publish_async ack future
        # pending for ever when the stream answers with an error (nats.py#985), so a refused
        # message would cost a whole timeout and hide the broker's reason.
        subject = self.subject_for(event)
        try:
            await self.js.publish(
                subject, event.model_dump_json().encode(), timeout=self.timeout, headers=headers
            )
        except _UNAVAILABLE as error:
            # No stream answers for this subject, though the server does: the destination is
            # missing, which is the event's own failure while other subjects are confirmed.
            missing = isinstance(error, _NO_DESTINATION)
            raise unavailable_error(
                "NATS", error, event, destination=subject if missing else None
            ) from error

    async def publish_many(self, events: Sequence[Event]) -> list[BaseException | None]:
        # Every request goes out before any ack is awaited: one round trip for the lot.
        results = await asyncio.gather(*map(self.publish, events), return_exceptions=True)
        return [result if isinstance(result, BaseException) else None for result in results]

    async def aclose(self) -> None:
        self.closed = True
        nc = self.connection
        if nc is None or nc.is_closed or nc.is_draining:
            return
        if nc.is_connected:
            await nc.drain()
        else:
            # drain() refuses a connection that is (re)connecting; close it as it is.
            await nc.close()
