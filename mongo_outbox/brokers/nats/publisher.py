"""NatsPublisher: NATS JetStream through nats-py, deduplicated by the broker on ``Nats-Msg-Id``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from mongo_outbox.brokers._publishing import (
    Naming,
    NamingFailed,
    check_naming,
    closed_error,
    message_headers,
    redact_url,
    render,
    template_fields,
)
from mongo_outbox.cloudevents import CloudEvents, check_option, message_of
from mongo_outbox.errors import (
    BrokerFullError,
    BrokerUnavailableError,
    InvalidEventError,
    describe,
)
from mongo_outbox.events import Event
from mongo_outbox.settings import Duration, check_seconds

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

from mongo_outbox.brokers.nats._jetstream import AckMux, Chunk, header_block, wait_all
from mongo_outbox.brokers.nats.errors import UNAVAILABLE, classify

log = logging.getLogger(__name__)

_DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default, when the connection is not known
# JetStream stores a header block's length in 16 bits and refuses a longer one (err_code
# 10097), whatever the server's max_payload.
MAX_HEADER_BYTES = 65535


def subject_of(naming: Naming, event: Event) -> str:
    """The subject ``naming`` gives ``event``; ``InvalidEventError`` if it cannot be rendered or
    is no subject a message can be published to."""
    return checked_subject(render(naming, event), event)


def checked_subject(subject: str, event: Event) -> str:
    # Wildcards and empty tokens are not publishable; whitespace would split the protocol line.
    if any(
        not token or "*" in token or ">" in token or any(c.isspace() for c in token)
        for token in subject.split(".")
    ):
        raise InvalidEventError(f"{subject!r} is not a valid NATS subject", event_id=event.id)
    return subject


_CHECKED_SUBJECTS = 4096
# Event fields validated into one str or int (True becomes 1): a subject memo keyed by their
# values cannot take one for another that compares equal but renders otherwise. An Event made
# with ``model_construct`` skips that validation, and the care that goes with it is its maker's.
_SCALAR_FIELDS = frozenset(
    {"id", "type", "aggregate_type", "aggregate_id", "sequence", "correlation_id", "causation_id"}
    | {"version"}
)


def memo_key(naming: Naming) -> Callable[[dict[str, Any]], object] | None:
    """What an Event's subject under ``naming`` depends on, read from its ``__dict__``; ``None``
    for a function or a template naming other fields."""
    roots = template_fields(naming) if isinstance(naming, str) else None
    if not roots or not _SCALAR_FIELDS.issuperset(roots):
        return None
    return operator.itemgetter(*roots)


# Messages (or body bytes) a chunk writes before it hands them to the connection and lets the
# loop run.
_HAND_OVER = 64
_HAND_OVER_BYTES = 1 << 20


class _NoAck(Exception):
    """A message whose ack did not come within the publisher's timeout."""


class NatsPublisher:
    """Publishes each event to a JetStream subject and waits for the stream's ack.

    The event id travels as ``Nats-Msg-Id``, so JetStream drops a republished event that falls
    within the stream's duplicate window (the ack then says ``duplicate``, and that counts as
    published). A subject must be bound to a stream: until one takes it, publishing raises
    ``BrokerUnavailableError``, and ``BrokerFullError`` while the stream (or the account's or
    server's JetStream storage) is full with the discard-new policy. An event NATS cannot carry
    raises ``InvalidEventError`` before it is sent: its headers over JetStream's 64 kB, or its
    headers and body over the connection's ``max_payload`` (the server would close the
    connection for it).

    Parameters:
        js: a ``JetStreamContext`` (``nc.jetstream()``); its connection stays the caller's.
        subject: template or function giving the subject; default
            ``"events.{aggregate_type}.{type}"``.
        timeout: seconds (or a ``timedelta``) to wait for each ack before raising
            ``BrokerUnavailableError``.
        cloudevents: publish CloudEvents 1.0 (``mongo_outbox.cloudevents``): in binary mode
            the attributes as ``ce-`` headers and the payload as the body (``Content-Type:
            application/json``), in structured mode one ``application/cloudevents+json``
            document; ``None`` (the default), the Event's own JSON.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        subject: Naming = "events.{aggregate_type}.{type}",
        timeout: Duration = 5.0,
        cloudevents: CloudEvents | None = None,
    ) -> None:
        self.js = js
        self.cloudevents = check_option(cloudevents, "NatsPublisher.cloudevents")
        self.subject = check_naming(subject, "NatsPublisher.subject")
        self.timeout = check_seconds(timeout, "NatsPublisher.timeout")
        self.closed = False
        self.connection: Client | None = None
        """The connection ``connect`` opened, which ``aclose`` closes; else ``None``."""
        self._mux: AckMux | None = None
        self._memo_naming: Naming | None = None
        self._key: Callable[[dict[str, Any]], object] | None = None
        self._subjects: dict[object, str] = {}

    @classmethod
    async def connect(
        cls,
        url: str = "nats://127.0.0.1:4222",
        *,
        subject: Naming = "events.{aggregate_type}.{type}",
        timeout: Duration = 5.0,
        cloudevents: CloudEvents | None = None,
    ) -> NatsPublisher:
        """Open a connection of its own, which ``aclose`` drains and closes.

        ``url`` may list several servers, comma-separated. Once connected it reconnects for
        as long as it takes; the first connection must succeed within ``2 * timeout`` or
        ``ConnectionError`` is raised. Logs and errors show ``url`` without its credentials.
        """
        wait = check_seconds(timeout, "NatsPublisher.timeout")
        # Before a connection that would outlive them.
        check_naming(subject, "NatsPublisher.subject")
        check_option(cloudevents, "NatsPublisher.cloudevents")
        shown = redact_url(url)

        async def log_error(error: Exception) -> None:
            log.warning("NATS connection to %s: %s", shown, describe(error))

        # nats-py takes several servers as a list, not as one comma-separated string.
        servers = [server.strip() for server in url.split(",")]
        # nats-py retries a refused first connection forever when reconnects are unlimited.
        try:
            nc = await asyncio.wait_for(
                nats.connect(
                    servers, connect_timeout=wait, max_reconnect_attempts=-1, error_cb=log_error
                ),
                2 * wait,
            )
        except asyncio.TimeoutError as error:
            raise ConnectionError(f"NATS at {shown} did not answer within {2 * wait}s") from error
        except (nats.errors.Error, OSError) as error:
            # The client's own text does not carry the URL; the chained error stays.
            raise ConnectionError(f"NATS at {shown}: {describe(error)}") from error
        publisher = cls(nc.jetstream(), subject=subject, timeout=wait, cloudevents=cloudevents)
        publisher.connection = nc
        return publisher

    def subject_for(self, event: Event) -> str:
        return subject_of(self.subject, event)

    def messaging_attributes(self, event: Event) -> dict[str, str]:
        """The OpenTelemetry messaging attributes of ``event``'s publish span."""
        return {"messaging.system": "nats", "messaging.destination.name": self.subject_for(event)}

    def _max_payload(self) -> int:
        limit = getattr(self._client(), "max_payload", 0)
        return limit if isinstance(limit, int) and limit > 0 else _DEFAULT_MAX_PAYLOAD

    def _client(self) -> Client | None:
        # A borrowed JetStreamContext does not expose its connection but as ``_nc``.
        return self.connection or getattr(self.js, "_nc", None)

    def _subject(self, event: Event) -> str:
        # Subjects repeat: each distinct one is rendered and checked once (a bounded memo), by
        # the values its template names where those are an Event's validated strings.
        if self.subject is not self._memo_naming:  # set anew since the last event
            self._memo_naming, self._key = self.subject, memo_key(self.subject)
            self._subjects = {}
        key = subject = None
        if self._key is not None and type(event) is Event:
            try:
                key = self._key(event.__dict__)
                subject = self._subjects.get(key)
            except (KeyError, TypeError):  # an Event made without validation
                key = None
        if subject is None:
            subject = checked_subject(render(self.subject, event), event)
            if key is not None:
                if len(self._subjects) >= _CHECKED_SUBJECTS:
                    self._subjects.clear()
                self._subjects[key] = subject
        return subject

    def _message(self, event: Event, limit: int) -> tuple[str, bytes, dict[str, str], bytes]:
        """The subject, body, headers and header block of ``event``'s message;
        ``InvalidEventError`` if NATS cannot carry it."""
        subject = self._subject(event)
        headers, body = self._content(event)
        headers["Nats-Msg-Id"] = event.id
        block = header_block(headers)
        # Refused here, as the event's own fault: the server would close the whole connection
        # for a message over max_payload, and JetStream refuses a header block over 64 kB.
        if len(block) > MAX_HEADER_BYTES:
            raise InvalidEventError(
                f"event {event.id} has {len(block)} bytes of NATS headers, over JetStream's "
                f"{MAX_HEADER_BYTES}",
                event_id=event.id,
            )
        if len(block) + len(body) > limit:
            raise InvalidEventError(
                f"event {event.id} is {len(block) + len(body)} bytes with its headers, over the "
                f"NATS server's max_payload of {limit}",
                event_id=event.id,
            )
        return subject, body, headers, block

    def _content(self, event: Event) -> tuple[dict[str, str], bytes]:
        # The NATS binding: ce- headers, and datacontenttype as the Content-Type header.
        headers, content_type, body = message_of(
            event, self.cloudevents, "ce-", message_headers(event)
        )
        headers["Content-Type"] = content_type
        return headers, body

    async def publish(self, event: Event) -> None:
        [error] = await self.publish_many([event])
        if error is not None:
            raise error

    async def publish_many(self, events: Sequence[Event]) -> list[BaseException | None]:
        # Every message goes out before any ack is awaited, each with its reply subject under
        # the ack mux's inbox: one round trip for the lot, and the stream's refusals at once.
        if self.closed:
            return [closed_error(self, event) for event in events]
        nc = self._client()
        if nc is None:
            raise TypeError("NatsPublisher needs the JetStreamContext of a nats-py connection")
        if self._mux is None or self._mux.nc is not nc:
            self._mux = AckMux(nc)
        mux = self._mux
        chunk = Chunk(len(events), asyncio.get_running_loop().create_future())
        outcomes = chunk.outcomes
        subjects: list[str | None] = [None] * len(events)
        closed_from = len(events)
        try:
            await mux.start()
            limit = self._max_payload()
            raw = mux.writable()
            count = size = 0
            for index, event in enumerate(events):
                if count >= _HAND_OVER or size >= _HAND_OVER_BYTES:
                    # The server stores the first messages while the rest are built, rather
                    # than idling until the whole chunk is written.
                    count = size = 0
                    await mux.flush()
                    await asyncio.sleep(0)
                    if self.closed:
                        closed_from = index
                        break
                    raw = mux.writable()
                try:
                    subject, body, headers, block = self._message(event, limit)
                except (InvalidEventError, NamingFailed) as error:
                    outcomes[index] = error
                    continue
                subjects[index] = subject
                reply = mux.expect(chunk, index)
                count += 1
                size += len(body)
                if raw:
                    mux.write(subject, reply, body, block)
                    continue
                try:
                    await mux.send(subject, reply, body, headers)
                except (nats.errors.Error, OSError) as error:
                    # Closed, draining, or its buffer full while it reconnects: not sent.
                    mux.unsend(chunk)
                    outcomes[index] = error
                if self.closed:  # during the send, which may yield
                    closed_from = index + 1
                    break
            await mux.flush()
            if mux.closed:
                # What was registered after the close awaits an ack nobody will read.
                for index in mux.abandon(chunk):
                    outcomes[index] = nats.errors.ConnectionClosedError()
            elif not await wait_all(chunk, self.timeout):
                for index in mux.abandon(chunk):
                    outcomes[index] = _NoAck()
        except UNAVAILABLE as error:
            # The ack subscription could not be made: nothing was sent.
            mux.abandon(chunk)
            return [self._result(event, error, None) for event in events]
        except BaseException:
            mux.abandon(chunk)
            raise
        return [
            self._result(event, outcome, subject)
            if index < closed_from
            else closed_error(self, event)
            for index, (event, outcome, subject) in enumerate(
                zip(events, outcomes, subjects, strict=True)
            )
        ]

    def _result(
        self, event: Event, error: BaseException | None, subject: str | None
    ) -> BaseException | None:
        """``error`` as the relay acts on it (``errors.classify``): for want of room, for want
        of a broker or a stream, or the stream's refusal of this message as it is."""
        if error is None or isinstance(error, InvalidEventError):
            return error
        if isinstance(error, _NoAck):
            return self._failed(event, f"no ack within {self.timeout:g}s")
        converted = classify(error, event, subject or "")
        if converted is None:
            return error  # the stream refused this message (too large, bad header...)
        if self.closed and not isinstance(converted, BrokerFullError):
            # Closed while the publish was in flight: that is why it failed, whatever the
            # client says (a closed or draining connection, a timeout).
            converted = closed_error(self, event)
        converted.__cause__ = error
        return converted

    def _failed(self, event: Event, reason: str) -> BrokerUnavailableError:
        if self.closed:
            return closed_error(self, event)
        return BrokerUnavailableError(f"NATS: {reason}", event_id=event.id)

    async def aclose(self) -> None:
        """Stop publishing; drain and close the connection ``connect`` opened. Never raises,
        and returns within ``2 * timeout``: a connection that cannot be drained (the server
        is gone, or takes nothing more) is closed as it is, its socket dropped."""
        self.closed = True
        if self._mux is not None:
            # Nothing in flight can be confirmed any more: fail it now, not at its timeout.
            with contextlib.suppress(Exception):
                await self._mux.close(nats.errors.ConnectionClosedError())
        nc = self.connection
        if nc is None or nc.is_closed or nc.is_draining:
            return
        if await _within(_shut(nc), self.timeout):
            if nc.is_closed:
                return
        else:
            # nats-py waits for the socket to take what it buffered, for ever from a server
            # that stopped reading; it has no abort of its own.
            log.warning(
                "NATS did not take the connection's close within %gs; its socket is dropped",
                self.timeout,
            )
            writer = getattr(nc._transport, "_io_writer", None)
            if isinstance(writer, asyncio.StreamWriter):
                writer.transport.abort()
        await _within(nc.close(), self.timeout)


async def _shut(nc: Client) -> None:
    if nc.is_connected:
        await nc.drain()
    else:
        # drain() refuses a connection that is (re)connecting; close it as it is.
        await nc.close()


async def _within(closing: Coroutine[Any, Any, None], seconds: float) -> bool:
    """Run one step of closing a connection; ``False`` if it took longer than ``seconds``
    (it is cancelled then). A failure is logged, not raised: closing must not fail the
    caller, and nothing nats-py buffered was confirmed, so the relay publishes it again."""
    # In a task of its own: nats-py's close, run while its reconnection waits for the dead
    # socket to close, cancels that shared wait and so raises CancelledError into its caller,
    # although nobody cancelled the caller. The task tells the two apart.
    task = asyncio.ensure_future(closing)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        return False
    failed = asyncio.CancelledError() if task.cancelled() else task.exception()
    if failed is not None:
        # e.g. nats-py 2.16 writes what it buffered during an outage into the dead socket and
        # fails (TypeError from asyncio) after marking the connection closed.
        log.debug("closing the NATS connection: %s", describe(failed))
    return True
