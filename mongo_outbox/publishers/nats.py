"""NatsPublisher: NATS JetStream through nats-py, deduplicated by the broker on ``Nats-Msg-Id``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from mongo_outbox.errors import InvalidEventError, PublishError
from mongo_outbox.events import Event
from mongo_outbox.publishers.base import Naming, message_headers, render

try:
    import nats
    from nats.js import JetStreamContext
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "NatsPublisher needs the nats extra: pip install 'mongo-outbox[nats]'"
    ) from error

log = logging.getLogger(__name__)


class NatsPublisher:
    """Publishes each event to a JetStream subject and waits for the stream's ack.

    The event id travels as ``Nats-Msg-Id``, so JetStream drops a republished event that falls
    within the stream's duplicate window. A subject must be bound to a stream, or the publish
    fails and the relay retries it.

    Parameters:
        js: a ``JetStreamContext`` (``nc.jetstream()``).
        subject: template or function giving the subject; default
            ``"events.{aggregate_type}.{type}"``.
        timeout: seconds to wait for the ack.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        subject: Naming = "events.{aggregate_type}.{type}",
        timeout: float = 5.0,
        connection: Any = None,
    ) -> None:
        self.js = js
        self.subject = subject
        self.timeout = timeout
        self._connection = connection

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
        return cls(nc.jetstream(), subject=subject, timeout=timeout, connection=nc)

    def subject_for(self, event: Event) -> str:
        subject = render(self.subject, event)
        tokens = subject.split(".")
        if not subject or any(
            not t or t in ("*", ">") or any(c.isspace() for c in t) for t in tokens
        ):
            raise InvalidEventError(f"{subject!r} is not a valid NATS subject", event_id=event.id)
        return subject

    async def publish(self, event: Event) -> None:
        [error] = await self.publish_many([event])
        if error is not None:
            raise error

    async def publish_many(self, events: Sequence[Event]) -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(events)
        pending: dict[asyncio.Future[Any], int] = {}
        for index, event in enumerate(events):
            headers = message_headers(event)
            headers["Nats-Msg-Id"] = event.id
            headers["Content-Type"] = "application/json"
            try:
                # publish_async only sends; every ack is awaited together below.
                future = await self.js.publish_async(
                    self.subject_for(event), event.model_dump_json().encode(), headers=headers
                )
            except Exception as error:  # noqa: BLE001 - reported per event, like a nack
                results[index] = error
            else:
                pending[future] = index
        if pending:
            await asyncio.wait(pending, timeout=self.timeout)
        for future, index in pending.items():
            event = events[index]
            if not future.done():
                future.cancel()
                results[index] = PublishError(
                    f"no ack for event {event.id} within {self.timeout}s", event_id=event.id
                )
            elif future.exception() is not None:
                results[index] = future.exception()
            elif not future.result().stream:
                results[index] = PublishError(
                    f"no stream acknowledged event {event.id}", event_id=event.id
                )
        return results

    async def aclose(self) -> None:
        if self._connection is not None and not self._connection.is_closed:
            await self._connection.drain()
