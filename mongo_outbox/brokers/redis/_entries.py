"""The Redis commands behind ``consume_redis``: reading and reclaiming entries (``Reader``) and
settling each one (``PendingEntry``). An entry is settled by its delivery: ``XACK``; a move to
the dead-letter stream (``XADD`` there and ``XACK`` here in one ``MULTI``); or a new idle time
(``XCLAIM ... IDLE ... JUSTID`` by its owner), which decides when a reclaim takes it again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import redis.exceptions

from mongo_outbox.consumers.base import decode

log = logging.getLogger("mongo_outbox.brokers.redis.consumer")  # the logger users configure

BLOCK_MS = 500  # how long XREADGROUP waits for entries: how soon the loop notices a stop
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

    async def set_idle(self, entry_id: bytes, idle_ms: int) -> None:
        # XCLAIM by its owner, JUSTID: the delivery count stays, the idle time is reset.
        await self.client.xclaim(
            self.stream, self.group, self.consumer, 0, [entry_id], idle=idle_ms, justid=True
        )


class PendingEntry:
    """An entry this consumer read and has not acknowledged yet: pending in its group until it
    is settled (a ``consumers.base.Delivery``)."""

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


class Reader:
    """Reads what there is to handle: reclaimed entries first, then new ones."""

    def __init__(self, entries: Entries, start_id: str, max_deliveries: int | None) -> None:
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

    async def read(self, wanted: int, in_flight: set[bytes]) -> list[PendingEntry]:
        await self._check_trimmed()  # before the read, which would move the group past a gap
        deliveries = await self._reclaim(wanted, in_flight)
        if deliveries:
            return deliveries
        entries = self.entries
        answer = await entries.client.xreadgroup(
            entries.group, entries.consumer, {entries.stream: ">"}, count=wanted, block=BLOCK_MS
        )
        return [
            PendingEntry(entries, entry_id, fields, 1, self.max_deliveries)
            for _, stream_entries in answer or ()
            for entry_id, fields in stream_entries
        ]

    async def _reclaim(self, wanted: int, in_flight: set[bytes]) -> list[PendingEntry]:
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
            PendingEntry(entries, entry_id, fields, counts.get(entry_id, 1), self.max_deliveries)
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
            info = await entries.client.xinfo_stream(entries.stream)
            groups = await entries.client.xinfo_groups(entries.stream)
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


def _entry_id(text: str) -> tuple[int, int]:
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence or 0)
