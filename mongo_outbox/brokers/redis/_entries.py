"""The Redis commands behind ``consume_redis``: reading and reclaiming entries (``Reader``) and
settling each one (``PendingEntry``). An entry is settled by its delivery: ``XACK``; a move to
the dead-letter stream (``XADD`` there, then ``XACK`` here); or a new idle time
(``XCLAIM ... IDLE ... JUSTID`` by its owner), which decides when a reclaim takes it again.

Three commands of one consumer set an entry's idle time: the keep-alive's ``XCLAIM`` (idle 0),
a settle's ``XCLAIM ... IDLE`` (due after the retry delay) and the reclaim's ``XAUTOCLAIM`` (idle
0, delivered). They go out on different connections of the client's pool, so Redis may run them
in another order than they were sent: a keep-alive run after the settle, or an entry reclaimed
after its settle but dropped as still in the process, would leave the entry untouched for a
whole ``claim_idle`` instead of the delay. ``Entries.lock`` runs them one at a time, each
bounded by ``ANSWER_WAIT`` (one unanswered command would hold the others up), and
``Entries.held`` maps each entry this consumer is handling to its delivery: a reclaim and a
keep-alive read it under the lock, and a delivery settles the entry only while it holds it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Mapping
from typing import Any

import redis.exceptions

from mongo_outbox._deadlines import within
from mongo_outbox.brokers._consuming import decode_delivery
from mongo_outbox.brokers.redis.errors import is_outage
from mongo_outbox.errors import ConfigurationError

log = logging.getLogger("mongo_outbox.brokers.redis.consumer")  # the logger users configure

BLOCK_MS = 500  # how long XREADGROUP waits for entries: how soon the loop notices a stop
_POLL_PAUSE = 0.1  # seconds between reads that do not block (see _block_ms)
_TRIM_CHECK_EVERY = 10.0  # seconds between checks that trimming has not passed the group
_BUSYGROUP = "BUSYGROUP"  # XGROUP CREATE: the group exists already


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Entries:
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
        self.lock = asyncio.Lock()
        self.held: dict[bytes, PendingEntry] = {}

    def holds(self, entry: PendingEntry) -> bool:
        return self.held.get(entry.entry_id) is entry

    async def set_idle(self, entry: PendingEntry, idle_ms: int) -> None:
        async with self.lock:
            if not self.holds(entry):
                # Its settle failed (no answer) and a reclaim has taken it since, for another
                # delivery: that one decides now.
                return
            try:
                # XCLAIM by its owner, JUSTID: the delivery count stays, the idle time is reset.
                await answer(
                    self.client.xclaim(
                        self.stream,
                        self.group,
                        self.consumer,
                        0,
                        [entry.entry_id],
                        idle=idle_ms,
                        justid=True,
                    )
                )
            finally:
                # Failed, the entry is still the group's: a reclaim takes it after claim_idle.
                del self.held[entry.entry_id]

    async def keep_alive(self) -> None:
        """Reset the idle time of every entry this consumer is handling: nobody reclaims them."""
        async with self.lock:
            if self.held:
                # Delivered "now" again, to this consumer.
                await answer(
                    self.client.xclaim(
                        self.stream, self.group, self.consumer, 0, list(self.held), justid=True
                    )
                )

    def settled(self, entry: PendingEntry) -> None:
        # Acknowledged (or moved): a keep-alive or reclaim after it finds it no longer pending.
        if self.holds(entry):
            del self.held[entry.entry_id]


ANSWER_WAIT = 5.0
"""Seconds a command run under ``Entries.lock`` waits for Redis's answer: far longer than a
live Redis takes; an unanswered one fails, as a lost connection does, and frees the lock."""


async def answer(command: Awaitable[Any], blocks: float = 0.0) -> Any:
    """``command``'s answer, within ``ANSWER_WAIT`` (and the ``blocks`` seconds it may block
    for): every command of the consumer is bounded, so that a Redis that stopped answering on
    an open connection (a client without ``socket_timeout``) holds no stop up."""
    wait = ANSWER_WAIT + blocks
    try:
        return await within(command, wait)
    except asyncio.TimeoutError as error:
        raise redis.exceptions.TimeoutError(f"no answer from Redis within {wait:g}s") from error


class PendingEntry:
    """An entry this consumer read and has not acknowledged yet: pending in its group until it
    is settled (a ``brokers._consuming.Delivery``)."""

    def __init__(
        self,
        entries: Entries,
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
        try:
            await answer(entries.client.xack(entries.stream, entries.group, self.entry_id))
        finally:
            entries.settled(self)

    async def reject(self) -> None:
        # settle() refuses an entry for the reason decode_delivery() gives: the dead letter's.
        reason = decode_delivery(self, None)
        await self.dead_letter(reason if isinstance(reason, str) else "rejected")

    async def dead_letter(self, reason: str) -> None:
        """Move the entry to the dead-letter stream: XADD there, then XACK here. Not in one
        MULTI: Redis runs the rest of a MULTI after a command that fails as it runs (a
        dead-letter key of another type), so the XACK dropped an entry whose copy was never
        made. A crash between the two leaves a copy and the entry pending: dead-lettered
        again, a second copy, never none."""
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
        try:
            await answer(entries.client.xadd(entries.dead, fields))
            await answer(entries.client.xack(entries.stream, entries.group, self.entry_id))
        finally:
            entries.settled(self)
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
        await self.entries.set_idle(self, idle_ms)

    async def give_back(self) -> None:
        # Idle for claim_idle at once: the next reclaim, of any consumer, takes it.
        await self.entries.set_idle(self, self.entries.idle_ms)


def _headers(raw: Any) -> Mapping[str, Any]:
    if raw is None:
        return {}
    try:
        headers = json.loads(raw)
    except ValueError:  # the body alone decides whether the entry can be handled
        return {}
    return headers if isinstance(headers, dict) else {}


class Reader:
    """Reads what there is to handle: reclaimed entries first, then new ones."""

    def __init__(self, entries: Entries, start_id: str, max_deliveries: int | None) -> None:
        self.entries = entries
        self.start_id = start_id
        self.max_deliveries = max_deliveries
        self.cursor: bytes | str = "0-0"
        self.trimmed: str | None = None
        self.checked = 0.0
        self.block_ms = _block_ms(entries.client)

    async def ensure_group(self) -> None:
        """Create the group (and the stream) unless it exists. ``ConfigurationError`` when the
        stream's or the dead-letter stream's key holds something else, or Redis refuses the
        group as given (``start_id``); an outage is raised as it is."""
        entries = self.entries
        for key, setting in ((entries.stream, "stream"), (entries.dead, "dead_letter_stream")):
            try:
                kind = _text(await answer(entries.client.type(key)))
            except redis.exceptions.NoPermissionError:
                continue  # an ACL with the stream commands only: the commands themselves say
            if kind not in ("none", "stream"):
                raise ConfigurationError(
                    f"the Redis key {key!r} holds a {kind}, not a stream",
                    setting=f"consume_redis.{setting}",
                )
        try:
            await answer(
                entries.client.xgroup_create(
                    entries.stream, entries.group, id=self.start_id, mkstream=True
                )
            )
        except redis.exceptions.ResponseError as error:
            if str(error).startswith(_BUSYGROUP):
                return
            if is_outage(error):
                raise
            wrong_type = str(error).startswith("WRONGTYPE")  # the key changed type meanwhile
            raise ConfigurationError(
                f"Redis refused group {entries.group!r} of stream {entries.stream!r} starting "
                f"at {self.start_id!r}: {error}",
                setting="consume_redis.stream" if wrong_type else "consume_redis.start_id",
            ) from error

    async def read(self, wanted: int) -> list[PendingEntry]:
        """Entries to handle, each held (``Entries.held``) until it is settled."""
        await self._check_trimmed()  # before the read, which would move the group past a gap
        deliveries = await self._reclaim(wanted)
        if deliveries:
            return deliveries
        entries = self.entries
        new = await answer(
            entries.client.xreadgroup(
                entries.group,
                entries.consumer,
                {entries.stream: ">"},
                count=wanted,
                block=self.block_ms,
            ),
            blocks=(self.block_ms or 0) / 1000,
        )
        if not new and self.block_ms is None:
            await asyncio.sleep(_POLL_PAUSE)  # the wait a blocking read would have had
        read = [
            PendingEntry(entries, entry_id, fields, 1, self.max_deliveries)
            for _, stream_entries in new or ()
            for entry_id, fields in stream_entries
        ]
        entries.held.update((entry.entry_id, entry) for entry in read)
        return read

    async def _reclaim(self, wanted: int) -> list[PendingEntry]:
        entries = self.entries
        async with entries.lock:
            claim = await answer(
                entries.client.xautoclaim(
                    entries.stream,
                    entries.group,
                    entries.consumer,
                    entries.idle_ms,
                    start_id=self.cursor,
                    count=wanted,
                )
            )
            # Our own held entries come back only if their keep-alive came too late.
            claimed = [(i, f) for i, f in claim[1] if f is not None and i not in entries.held]
        self.cursor = claim[0]
        deleted = list(claim[2]) if len(claim) > 2 else []  # Redis >= 7 lists them
        # Redis 6.2 returns a deleted entry with no fields instead (and leaves it pending).
        deleted += [entry_id for entry_id, fields in claim[1] if fields is None]
        for entry_id in deleted:
            log.error(
                "entry %s of stream %s was deleted (trimmed: see maxlen) before group %s "
                "acknowledged it: it is lost to this group",
                _text(entry_id),
                entries.stream,
                entries.group,
            )
        if deleted:
            await answer(entries.client.xack(entries.stream, entries.group, *deleted))
        counts = await self._delivery_counts([entry_id for entry_id, _ in claimed])
        reclaimed = [
            PendingEntry(entries, entry_id, fields, counts.get(entry_id, 1), self.max_deliveries)
            for entry_id, fields in claimed
        ]
        # Held from here, not before: a read that fails leaves them to a reclaim, not kept alive.
        entries.held.update((entry.entry_id, entry) for entry in reclaimed)
        return reclaimed

    async def _delivery_counts(self, ids: list[bytes]) -> dict[bytes, int]:
        if not ids or self.max_deliveries is None:
            return {}  # only a delivery limit needs them: spare the round trip
        entries = self.entries
        async with entries.client.pipeline(transaction=False) as pipeline:
            for entry_id in ids:
                pipeline.xpending_range(entries.stream, entries.group, entry_id, entry_id, 1)
            answers = await answer(pipeline.execute())
        return {
            pending[0]["message_id"]: int(pending[0]["times_delivered"])
            for pending in answers
            if pending
        }

    async def _check_trimmed(self) -> None:
        """Log an error when the stream's oldest entry is past the group's last read one while
        entries were trimmed: the publisher's ``maxlen`` is too small for how far this group
        falls behind. Every ten seconds: a group that falls behind and catches up in between
        is not noticed."""
        loop = asyncio.get_running_loop()
        if loop.time() - self.checked < _TRIM_CHECK_EVERY:
            return
        self.checked = loop.time()
        entries = self.entries
        try:
            info = await answer(entries.client.xinfo_stream(entries.stream))
            groups = await answer(entries.client.xinfo_groups(entries.stream))
        except redis.exceptions.ResponseError:  # the stream is gone: the next read says so
            return
        first = info.get("first-entry")
        trimmed = int(info.get("entries-added", 0)) > int(info.get("length", 0))  # Redis >= 7
        if not first or not trimmed:
            return
        oldest = _text(first[0])
        for group in groups:
            read = _text(group["last-delivered-id"])
            behind = _entry_id(read) < _entry_id(oldest)
            if _text(group["name"]) == entries.group and behind and oldest != self.trimmed:
                self.trimmed = oldest
                # "Likely": nothing is lost when the entry after the last read one is exactly
                # the oldest left, which Redis 7.0's counters cannot tell apart.
                log.error(
                    "stream %s was trimmed up to %s, past group %s's last read entry %s: "
                    "entries it never read are likely lost to it (raise the publisher's maxlen)",
                    entries.stream,
                    oldest,
                    entries.group,
                    read,
                )


def _block_ms(client: Any) -> int | None:
    """``BLOCK_MS``, or ``None`` (reads that do not block) under a client socket timeout that
    a blocking read could outlast: each would fail as a timeout, a warning a second on an
    idle stream. Redis ends a block on its own timer (10 times a second by default), so a
    read may block about 100 ms longer than asked."""
    pool = getattr(client, "connection_pool", None)
    # A RedisCluster has no pool of its own: its nodes' settings are its own.
    settings = getattr(pool, "connection_kwargs", None) or getattr(client, "connection_kwargs", {})
    timeout = settings.get("socket_timeout") if isinstance(settings, dict) else None
    if isinstance(timeout, (int, float)) and timeout < BLOCK_MS / 1000 + 0.5:
        return None
    return BLOCK_MS


def _entry_id(text: str) -> tuple[int, int]:
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence or 0)
