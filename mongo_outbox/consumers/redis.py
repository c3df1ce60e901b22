"""Run a guarded handler on a Redis stream through a consumer group, and settle each entry.

An entry is acknowledged (XACK) only once the guard has stored its outcome. Redis keeps every
entry a consumer read and did not acknowledge in the group's pending list, with the time since
it was last delivered (its idle time): ``consume_redis`` reclaims (XAUTOCLAIM) entries idle for
``claim_idle``, those of a consumer that died mid-handler, so another consumer finishes them.
While an entry is in the process it resets the entry's idle time every third of ``claim_idle``,
so a slow handler's entry is not reclaimed from under it.

A retry is not held in the process: the entry stays pending, its idle time set to
``claim_idle - delay``, so that it is reclaimed (by any consumer of the group) once the backoff
delay has passed, or after ``claim_idle`` when the delay is longer. Redis has no delivery limit
and no dead-letter destination of its own: a dead-lettered entry, and one that cannot be handled
at all (no ``event-id`` field, a body that is not an Event), is added to the dead-letter stream
and acknowledged in one transaction, never dropped. ``max_deliveries`` (XPENDING's delivery
count) makes a delivery the last, like a quorum queue's delivery limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import uuid
from collections.abc import Mapping
from typing import Any

from mongo_outbox.consumers.base import (
    Dispatcher,
    Rejected,
    check_source,
    decode,
    delivery_limit_of,
)
from mongo_outbox.errors import ConfigurationError, describe
from mongo_outbox.guard import Guarded
from mongo_outbox.settings import Duration, count, seconds

try:
    import redis.asyncio
    import redis.exceptions
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the Redis consumer needs the redis extra: pip install 'mongo-outbox[redis]'"
    ) from error

log = logging.getLogger(__name__)

_BLOCK_MS = 500  # how long XREADGROUP waits for entries: how soon the loop notices a stop
_OUTAGE_PAUSE = 1.0  # seconds between attempts while Redis cannot be reached
_TRIM_CHECK_EVERY = 10.0  # seconds between checks that trimming has not passed the group
_BUSYGROUP = "BUSYGROUP"  # XGROUP CREATE: the group exists already
# The stream or the group is gone (deleted, or a Redis restarted without its data): NOGROUP for
# a read that starts then, UNBLOCKED for one that was waiting on the stream.
_GONE = ("NOGROUP", "UNBLOCKED")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _Entries:
    """What every delivery of one consume_redis call shares: where and how to settle."""

    def __init__(
        self, client: Any, stream: str, group: str, consumer: str, dead: str, idle_ms: int
    ) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead = dead
        self.idle_ms = idle_ms

    async def set_idle(self, entry_id: bytes, idle_ms: int) -> None:
        # XCLAIM by its owner, JUSTID: the delivery count stays, the idle time is reset.
        await self.client.xclaim(
            self.stream, self.group, self.consumer, 0, [entry_id], idle=idle_ms, justid=True
        )


class _Delivery:
    def __init__(
        self,
        entries: _Entries,
        entry_id: bytes,
        fields: Mapping[Any, Any],
        delivered: int,
        max_deliveries: int | None,
    ) -> None:
        self.entries = entries
        self.entry_id = entry_id
        self.fields = {_text(name): value for name, value in fields.items()}
        raw_id = self.fields.get("event-id")
        try:
            self.message_id: object = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
        except UnicodeDecodeError:
            self.message_id = raw_id  # not a str: refused as an id, dead-lettered
        body = self.fields.get("body", b"")
        self.body: bytes = body.encode() if isinstance(body, str) else body
        self.headers: Mapping[str, Any] = _headers(self.fields.get("headers"))
        self.delivered = delivered
        self.last = max_deliveries is not None and delivered >= max_deliveries

    async def ack(self) -> None:
        entries = self.entries
        await entries.client.xack(entries.stream, entries.group, self.entry_id)

    async def reject(self) -> None:
        # settle() refuses an entry for the reason decode() gives; the dead letter says it.
        reason = decode(self.message_id, self.body)
        await self.dead_letter(reason if isinstance(reason, str) else "rejected")

    async def dead_letter(self, reason: str) -> None:
        """Move the entry to the dead-letter stream: XADD there and XACK here, atomically."""
        entries = self.entries
        fields = dict(self.fields)
        fields.update(
            {
                "dead-letter-reason": reason,
                "dead-letter-stream": entries.stream,
                "dead-letter-group": entries.group,
                "dead-letter-entry": _text(self.entry_id),
                "dead-letter-deliveries": str(self.delivered),
            }
        )
        async with entries.client.pipeline(transaction=True) as pipeline:
            pipeline.xadd(entries.dead, fields)
            pipeline.xack(entries.stream, entries.group, self.entry_id)
            await pipeline.execute()
        log.error(
            "entry %s of stream %s dead-lettered to %s: %s",
            _text(self.entry_id),
            entries.stream,
            entries.dead,
            reason,
        )

    async def retry_after(self, delay: float, stop: asyncio.Event) -> None:
        # Left pending, idle as if delivered claim_idle - delay ago: reclaimed after the delay.
        idle_ms = max(0, self.entries.idle_ms - int(delay * 1000))
        await self.entries.set_idle(self.entry_id, idle_ms)

    async def give_back(self) -> None:
        # Idle for claim_idle at once: the next reclaim, of any consumer, takes it.
        await self.entries.set_idle(self.entry_id, self.entries.idle_ms)


def _headers(raw: Any) -> Mapping[str, Any]:
    if raw is None:
        return {}
    try:
        headers = json.loads(raw)
    except ValueError:  # the body alone decides whether the entry can be handled
        return {}
    return headers if isinstance(headers, dict) else {}


def default_consumer_name() -> str:
    """``host-pid-random``: a consumer name no other process of the group uses."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


async def consume_redis(
    client: redis.asyncio.Redis,
    stream: str,
    group: str,
    guarded: Guarded,
    *,
    consumer: str | None = None,
    dead_letter_stream: str | None = None,
    claim_idle: Duration = 30.0,
    max_deliveries: int | None = None,
    start_id: str = "0",
    ordered: bool = False,
    batch: int = 32,
    max_in_flight: int | None = None,
    source: str | None = None,
    rejected: Rejected | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Read ``stream`` as ``consumer`` of ``group`` until ``stop`` is set or the task is
    cancelled, creating the group (and the stream) if absent.

    Parameters:
        client: a ``redis.asyncio.Redis`` client; it stays the caller's.
        consumer: this consumer's name in the group; default: one of its own
            (``default_consumer_name``). A restarted consumer that keeps its name finds its
            pending entries again at once; a new name finds them after ``claim_idle``.
        dead_letter_stream: where entries that cannot or must not be handled go; default
            ``"{stream}:dead"``.
        claim_idle: seconds (or a ``timedelta``) an entry stays pending, unacknowledged and
            untouched, before any consumer of the group reclaims it: longer than a handler
            may take without this consumer's keep-alive (a stalled process), shorter than you
            would wait for a crashed consumer's entries.
        max_deliveries: deliveries of an entry after which a failure is dead-lettered;
            ``None``: unlimited (the guard's ``max_attempts`` still bounds the handler's runs).
        start_id: where a group created here starts: ``"0"`` (default) reads what the stream
            already holds, ``"$"`` only what is added from now on.

    ``ordered``, ``batch``, ``max_in_flight``, ``source``, ``rejected`` and ``stop`` are as for
    ``consume_nats``. On stop, running handlers finish and settle, and entries held for a retry
    or waiting their turn are made reclaimable at once.
    """
    for setting, value in (("consume_redis.stream", stream), ("consume_redis.group", group)):
        if not isinstance(value, str) or not value:
            raise ConfigurationError(
                f"{setting} must be a non-empty str, not {value!r}", setting=setting
            )
    consumer = default_consumer_name() if consumer is None else consumer
    dead = f"{stream}:dead" if dead_letter_stream is None else dead_letter_stream
    if not consumer or not dead or dead == stream:
        raise ConfigurationError(
            "consume_redis needs a consumer name and a dead-letter stream other than the stream",
            setting="consume_redis.dead_letter_stream",
        )
    idle = seconds(claim_idle, "consume_redis.claim_idle")
    limit_deliveries = delivery_limit_of(max_deliveries, "consume_redis.max_deliveries") or None
    batch = count(batch, "consume_redis.batch")
    limit = batch if max_in_flight is None else count(max_in_flight, "consume_redis.max_in_flight")
    check_source(source, "consume_redis.source")
    stop = stop or asyncio.Event()
    entries = _Entries(client, stream, group, consumer, dead, int(idle * 1000))
    reader = _Reader(entries, start_id, limit_deliveries)
    await reader.ensure_group()
    dispatcher = Dispatcher(guarded, source=source, rejected=rejected, ordered=ordered)
    ticker = asyncio.create_task(_keep_alive(entries, dispatcher, idle / 3))
    try:
        while not stop.is_set():
            await dispatcher.room(limit, stop)
            if stop.is_set():
                break
            in_flight = {
                d.entry_id for d in dispatcher.in_flight.values() if isinstance(d, _Delivery)
            }
            wanted = min(batch, limit - len(dispatcher.in_flight))
            try:
                deliveries = await reader.read(wanted, in_flight)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as error:
                log.warning("reading stream %s: %s; trying again", stream, describe(error))
                await asyncio.sleep(_OUTAGE_PAUSE)
                continue
            except redis.exceptions.ResponseError as error:
                if not str(error).startswith(_GONE):
                    raise
                log.warning("group %s of stream %s is gone: creating it again", group, stream)
                await reader.ensure_group()
                continue
            for delivery in deliveries:
                dispatcher.dispatch(delivery)
    finally:
        await dispatcher.drain()
        ticker.cancel()


class _Reader:
    """Reads what there is to handle: reclaimed entries first, then new ones."""

    def __init__(self, entries: _Entries, start_id: str, max_deliveries: int | None) -> None:
        self.entries = entries
        self.start_id = start_id
        self.max_deliveries = max_deliveries
        self.cursor: bytes | str = "0-0"
        self.trimmed: str | None = None
        self.checked = 0.0

    async def ensure_group(self) -> None:
        entries = self.entries
        try:
            await entries.client.xgroup_create(
                entries.stream, entries.group, id=self.start_id, mkstream=True
            )
        except redis.exceptions.ResponseError as error:
            if not str(error).startswith(_BUSYGROUP):
                raise

    async def read(self, wanted: int, in_flight: set[bytes]) -> list[_Delivery]:
        deliveries = await self._reclaim(wanted, in_flight)
        if deliveries:
            return deliveries
        entries = self.entries
        answer = await entries.client.xreadgroup(
            entries.group, entries.consumer, {entries.stream: ">"}, count=wanted, block=_BLOCK_MS
        )
        found = [
            _Delivery(entries, entry_id, fields, 1, self.max_deliveries)
            for _, stream_entries in answer or ()
            for entry_id, fields in stream_entries
        ]
        await self._check_trimmed()
        return found

    async def _reclaim(self, wanted: int, in_flight: set[bytes]) -> list[_Delivery]:
        entries = self.entries
        answer = await entries.client.xautoclaim(
            entries.stream,
            entries.group,
            entries.consumer,
            entries.idle_ms,
            start_id=self.cursor,
            count=wanted,
        )
        self.cursor, claimed = answer[0], answer[1]
        deleted = list(answer[2]) if len(answer) > 2 else []  # Redis >= 7 lists them
        # Redis 6.2 returns a deleted entry with no fields instead (and leaves it pending).
        deleted += [entry_id for entry_id, fields in claimed if fields is None]
        for entry_id in deleted:
            log.error(
                "entry %s of stream %s was deleted (trimmed: see maxlen) before group %s "
                "acknowledged it: it is lost to this group",
                _text(entry_id),
                entries.stream,
                entries.group,
            )
        if deleted:
            await entries.client.xack(entries.stream, entries.group, *deleted)
        # Our own in-flight entries come back only if their keep-alive came too late.
        claimed = [(i, f) for i, f in claimed if f is not None and i not in in_flight]
        counts = await self._delivery_counts([entry_id for entry_id, _ in claimed])
        return [
            _Delivery(entries, entry_id, fields, counts.get(entry_id, 1), self.max_deliveries)
            for entry_id, fields in claimed
        ]

    async def _delivery_counts(self, ids: list[bytes]) -> dict[bytes, int]:
        if not ids or self.max_deliveries is None:
            return {}  # only a delivery limit needs them: spare the round trip
        entries = self.entries
        async with entries.client.pipeline(transaction=False) as pipeline:
            for entry_id in ids:
                pipeline.xpending_range(entries.stream, entries.group, entry_id, entry_id, 1)
            answers = await pipeline.execute()
        return {
            pending[0]["message_id"]: int(pending[0]["times_delivered"])
            for pending in answers
            if pending
        }

    async def _check_trimmed(self) -> None:
        """Log an error when trimming removed entries the group had not read yet: the
        publisher's ``maxlen`` is too small for how far this group falls behind."""
        loop = asyncio.get_running_loop()
        if loop.time() - self.checked < _TRIM_CHECK_EVERY:
            return
        self.checked = loop.time()
        entries = self.entries
        try:
            info = await entries.client.xinfo_stream(entries.stream)
            groups = await entries.client.xinfo_groups(entries.stream)
        except redis.exceptions.ResponseError:  # the stream is gone: the next read says so
            return
        deleted = _text(info.get("max-deleted-entry-id", "0-0"))  # Redis >= 7
        if deleted == "0-0" or deleted == self.trimmed:
            return
        for group in groups:
            if _text(group["name"]) == entries.group:
                read = _text(group["last-delivered-id"])
                if _entry_id(deleted) > _entry_id(read):
                    self.trimmed = deleted
                    log.error(
                        "stream %s was trimmed up to %s, past group %s's last read entry %s: "
                        "entries it never read are lost to it (raise the publisher's maxlen)",
                        entries.stream,
                        deleted,
                        entries.group,
                        read,
                    )


def _entry_id(text: str) -> tuple[int, int]:
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence or 0)


async def _keep_alive(entries: _Entries, dispatcher: Dispatcher, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        ids = [d.entry_id for d in dispatcher.in_flight.values() if isinstance(d, _Delivery)]
        if not ids:
            continue
        try:
            # Delivered "now" again, to this consumer: not idle, so nobody reclaims them.
            await entries.client.xclaim(
                entries.stream, entries.group, entries.consumer, 0, ids, justid=True
            )
        except Exception as error:  # noqa: BLE001 - the next tick, or a reclaim
            log.warning("keep-alive of %d entries failed: %s", len(ids), describe(error))
