"""RedisStreamsPublisher: Redis Streams through redis-py's asyncio client, one XADD per event.

Redis has nothing to deduplicate an XADD on (before Redis 8's idempotent XADD), so a republished
event is a second entry: the consumer's inbox (``consume_redis``) makes its effect happen once.
An entry's fields are the event's id, the fields consumers route on, its headers and its body,
encoded as the other publishers encode them (``ENTRY_FIELDS`` lists them).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Sequence
from typing import Any

from mongo_outbox.brokers._publishing import (
    Naming,
    NamingFailed,
    check_naming,
    client_call,
    closed_error,
    message_headers,
    redact_url,
    render,
)
from mongo_outbox.cloudevents import CloudEvents, check_option, message_of
from mongo_outbox.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    InvalidEventError,
    describe,
)
from mongo_outbox.events import Event
from mongo_outbox.settings import Duration, check_count, check_seconds

try:
    import redis.asyncio
    import redis.exceptions

    from mongo_outbox.brokers.redis.errors import classify
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "RedisStreamsPublisher needs the redis extra: pip install 'mongo-outbox[redis]'"
    ) from error

log = logging.getLogger(__name__)

ENTRY_FIELDS = ("event-id", "event-type", "aggregate-type", "aggregate-id", "headers", "body")
"""An entry's fields: ``event-id`` (what the inbox deduplicates on), ``event-type``,
``aggregate-type`` and ``aggregate-id`` (left out when the event has none), ``headers`` (a JSON
object: the event's headers and the fields consumers route on, as the other publishers send
them) and ``body`` (the whole event as JSON, ``Event.from_json`` reads it back)."""

DEFAULT_MAXLEN = 100_000
"""Entries a stream keeps, approximately (``MAXLEN ~``), unless told otherwise."""

_MAX_CONNECTIONS = 32  # connect()'s pool: publish_many needs two, each publish in flight one


def stream_of(naming: Naming, event: Event) -> str:
    """The stream ``naming`` gives ``event``; ``InvalidEventError`` when it cannot be rendered
    or is empty."""
    stream = render(naming, event)
    if not stream:
        raise InvalidEventError(f"{naming!r} gives event {event.id} no stream", event_id=event.id)
    return stream


def entry_of(event: Event) -> dict[str, str]:
    """The fields of ``event``'s stream entry (``ENTRY_FIELDS``)."""
    headers = message_headers(event)
    fields = {"event-id": event.id, "event-type": event.type}
    for name in ("aggregate-type", "aggregate-id"):
        if name in headers:
            fields[name] = headers[name]
    fields["headers"] = json.dumps(headers, separators=(",", ":"))
    fields["body"] = event.model_dump_json()
    return fields


def _checked_maxlen(maxlen: int | None) -> int | None:
    if maxlen is None:
        return None
    count = check_count(maxlen, "RedisStreamsPublisher.maxlen")
    if count >= 2**63:  # Redis's MAXLEN is a signed 64-bit integer: every XADD was refused
        raise ConfigurationError(
            f"RedisStreamsPublisher.maxlen {count} is beyond what Redis takes (2**63 - 1)",
            setting="RedisStreamsPublisher.maxlen",
        )
    return count


class RedisStreamsPublisher:
    """Appends each event to a Redis stream (XADD) and returns once Redis has it.

    Redis answers an XADD once the entry is in memory: with ``appendonly yes`` and ``appendfsync
    always`` it is also on disk, otherwise a Redis crash can lose confirmed entries (see
    docs/redis.md). Failures that are not the event's raise ``BrokerUnavailableError``, so the
    relay waits without parking anything: no connection, a replica, a server that cannot
    persist, a forbidden command; ``BrokerFullError`` when Redis is out of memory
    (``maxmemory`` with ``noeviction``). A key of another type under the stream's name raises
    ``BrokerUnavailableError`` with its ``destination``, the event's own failure while other
    streams take their events.

    Parameters:
        client: a ``redis.asyncio.Redis`` client; it stays the caller's.
        stream: template or function giving the stream's key; default
            ``"events:{aggregate_type}"``.
        maxlen: entries each stream keeps, approximately (``XADD ... MAXLEN ~ maxlen``): older
            ones are trimmed whether or not every consumer group has read them. ``None`` never
            trims. See docs/redis.md before lowering it.
        timeout: seconds (or a ``timedelta``) a publish may take before it raises
            ``BrokerUnavailableError``.
        cloudevents: write CloudEvents 1.0 (``mongo_outbox.cloudevents``). Redis has no
            CloudEvents binding, so an entry keeps its fields and its ``headers`` field holds
            what a NATS message's headers would: in binary mode the attributes as ``ce-``
            headers and ``content-type: application/json``, the payload as ``body``; in
            structured mode ``content-type: application/cloudevents+json`` and the document as
            ``body``. ``None`` (the default), the Event's own JSON.
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        stream: Naming = "events:{aggregate_type}",
        maxlen: int | None = DEFAULT_MAXLEN,
        timeout: Duration = 5.0,
        cloudevents: CloudEvents | None = None,
    ) -> None:
        self.redis: Any = client
        self.cloudevents = check_option(
            cloudevents, "RedisStreamsPublisher.cloudevents"
        )  # redis-py types its commands as "awaitable or not": untyped here
        self.stream = check_naming(stream, "RedisStreamsPublisher.stream")
        self.maxlen = _checked_maxlen(maxlen)
        self.timeout = check_seconds(timeout, "RedisStreamsPublisher.timeout")
        if not inspect.iscoroutinefunction(getattr(client, "execute_command", None)):
            # A synchronous client runs each XADD, then fails on awaiting its answer: every
            # retry added the entry again, and the event was parked in the end.
            raise ConfigurationError(
                "RedisStreamsPublisher needs an asyncio client (redis.asyncio.Redis), not "
                f"{type(client).__module__}.{type(client).__qualname__}",
                setting="RedisStreamsPublisher.client",
            )
        self.closed = False
        self.owned = False
        """Whether ``aclose`` closes the client (``connect`` opened it)."""

    @classmethod
    async def connect(
        cls,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        stream: Naming = "events:{aggregate_type}",
        maxlen: int | None = DEFAULT_MAXLEN,
        timeout: Duration = 5.0,
        cloudevents: CloudEvents | None = None,
    ) -> RedisStreamsPublisher:
        """Open a client of its own (which ``aclose`` closes) and check that Redis answers.

        Raises ``ConnectionError`` when Redis cannot be reached; it shows ``url`` without its
        password."""
        wait = check_seconds(timeout, "RedisStreamsPublisher.timeout")
        check_naming(stream, "RedisStreamsPublisher.stream")  # before a client is opened
        _checked_maxlen(maxlen)
        check_option(cloudevents, "RedisStreamsPublisher.cloudevents")
        try:
            # A blocking pool: a publish waits for a free connection (up to the timeout) rather
            # than failing as an outage when many are in flight.
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                url,
                max_connections=_MAX_CONNECTIONS,
                timeout=wait,
                socket_timeout=wait,
                socket_connect_timeout=wait,
            )
            client = redis.asyncio.Redis.from_pool(pool)
        except ValueError as error:
            raise ConfigurationError(
                f"not a Redis URL: {redact_url(url)}", setting="RedisStreamsPublisher.url"
            ) from error
        try:
            await asyncio.wait_for(client.ping(), 2 * wait)
        except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError) as error:
            await client.aclose()
            raise ConnectionError(f"Redis at {redact_url(url)}: {describe(error)}") from error
        publisher = cls(client, stream=stream, maxlen=maxlen, timeout=wait, cloudevents=cloudevents)
        publisher.owned = True
        return publisher

    def stream_for(self, event: Event) -> str:
        return stream_of(self.stream, event)

    def _fields(self, event: Event) -> dict[str, str]:
        """The entry's fields; ``InvalidEventError`` for an event CloudEvents cannot carry."""
        if self.cloudevents is None:
            return entry_of(event)
        fields = entry_of(event)
        headers, content_type, body = message_of(
            event, self.cloudevents, "ce-", message_headers(event)
        )
        headers["content-type"] = content_type
        fields["headers"] = json.dumps(headers, separators=(",", ":"))
        fields["body"] = body.decode()
        return fields

    def _xadd(self, target: Any, stream: str, fields: dict[str, str]) -> Any:
        trim = {} if self.maxlen is None else {"maxlen": self.maxlen, "approximate": True}
        return target.xadd(stream, fields, **trim)

    async def publish(self, event: Event) -> None:
        if self.closed:
            raise closed_error(self, event)
        stream = self.stream_for(event)
        fields = self._fields(event)
        try:
            await client_call(
                self._xadd(self.redis, stream, fields),
                self.timeout,
                lambda reason: self._failed(event, reason),
            )
        except Exception as error:
            classified = self._classify(event, error, stream)
            if classified is error:
                raise
            raise classified from error

    async def publish_many(self, events: Sequence[Event]) -> list[BaseException | None]:
        """Every XADD in one pipeline (not a transaction): one round trip for the wave."""
        results: list[BaseException | None] = [None] * len(events)
        sent: list[tuple[int, str]] = []
        pipeline = self.redis.pipeline(transaction=False)
        for index, event in enumerate(events):
            if self.closed:
                results[index] = closed_error(self, event)
                continue
            try:
                stream = self.stream_for(event)
                fields = self._fields(event)
            except (InvalidEventError, NamingFailed) as error:
                results[index] = error
                continue
            self._xadd(pipeline, stream, fields)
            sent.append((index, stream))
        if not sent:
            return results
        first = events[sent[0][0]]
        try:
            answers = await client_call(
                pipeline.execute(raise_on_error=False),
                self.timeout,
                lambda reason: self._failed(first, reason),
            )
        except Exception as error:  # noqa: BLE001 - every event of the wave gets the verdict
            # The connection failed: Redis may have some of the entries, which the relay then
            # publishes again (the inbox makes their effects happen once).
            for index, stream in sent:
                if isinstance(error, BrokerUnavailableError):  # the timeout: told of the first
                    results[index] = BrokerUnavailableError(str(error), event_id=events[index].id)
                else:
                    results[index] = self._classify(events[index], error, stream)
            return results
        for (index, stream), answer in zip(sent, answers, strict=True):
            if isinstance(answer, Exception):
                results[index] = self._classify(events[index], answer, stream)
        return results

    def _classify(self, event: Event, error: BaseException, stream: str) -> BaseException:
        """What the relay should make of a client's error (see the Publisher protocol)."""
        if isinstance(error, BrokerUnavailableError):
            return error
        if self.closed:
            return closed_error(self, event)
        return classify(error, event, stream) or error

    def _failed(self, event: Event, reason: str) -> BrokerUnavailableError:
        if self.closed:
            return closed_error(self, event)
        return BrokerUnavailableError(f"Redis: {reason}", event_id=event.id)

    async def aclose(self) -> None:
        """Stop publishing and close the client ``connect`` opened. Never raises."""
        self.closed = True
        if self.owned:
            try:
                await self.redis.aclose()
            except Exception as error:  # noqa: BLE001 - closing must not fail the caller
                log.debug("closing the Redis client: %s", describe(error))
