"""What the console shows, read through the outbox's admin (``mongo_outbox.admin``) as
``status``, ``parked list`` and ``inbox failed`` read it: one look at the outbox for each page,
and a sampler that keeps the last minutes of backlog and publishing for the chart.

The one reading of its own is how many events were published between two samples. Nothing
counts them in MongoDB, but every published entry gets ``expire_at`` = its publication time
plus the outbox's retention, under the TTL index (the outbox collection in collection mode, the
event-id registry in embedded mode). So the entries whose ``expire_at`` is past the latest one
seen at the previous sample are exactly those published since: an index range, whatever the
retention, as long as it stays the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pymongo.errors import PyMongoError

from mongo_outbox.admin import EventEntry, OutboxAdmin, ParkedEntry, ParkedPage
from mongo_outbox.cli.common import Connection, Target, one_line
from mongo_outbox.cli.status import gather
from mongo_outbox.errors import OutboxError
from mongo_outbox.events import utc_now
from mongo_outbox.inbox import Inbox

log = logging.getLogger("mongo_outbox.cli")

SHOWN = 200
"""Rows a table shows at most (parked events, a page of them; failed messages per consumer):
the page stays quick; the command line lists them all."""


@dataclass(frozen=True)
class Places:
    """The collections the console reads beside the outbox."""

    checkpoints: str = "outbox_relays"
    inbox: str = "inbox"
    members: str = "outbox_relay_members"


def admin(conn: Connection, places: Places | None = None) -> OutboxAdmin:
    """The admin of ``conn``'s outbox, with the collections of ``places`` beside it."""
    places = places or Places()
    return OutboxAdmin(
        conn.outbox, checkpoints=places.checkpoints, inbox=places.inbox, members=places.members
    )


async def overview(conn: Connection, target: Target, places: Places) -> dict[str, Any]:
    """``mongo-outbox status``'s report, with the relay groups' partitions set apart: each
    partition of each group with its owner, also those nobody ever held."""
    report = await gather(conn, target, places.checkpoints, places.inbox)
    count = await admin(conn, places).partitions()
    relays: list[dict[str, Any]] = []
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for relay in report["relays"]:
        group, _, number = relay["name"].rpartition("/")
        if group and number.isdigit():
            groups.setdefault(group, {})[int(number)] = relay
        else:
            relays.append(relay)
    report["relays"] = relays
    report["groups"] = [
        {
            "name": name,
            "partitions": [
                {"partition": k, **leases.get(k, {"state": "inactive", "lease_holder": None})}
                for k in range(max(count, max(leases) + 1))
            ],
            "members": await _members(conn, places, name),
        }
        for name, leases in sorted(groups.items())
    ]
    return report


async def backlog(conn: Connection) -> dict[str, Any]:
    """One outbox's row of the ``--databases`` table: its backlog and parked count, as
    ``status`` reads them."""
    counts = await admin(conn).backlog()
    oldest = counts.oldest_age()
    return {
        "database": conn.db.name,
        "pending": counts.pending,
        "oldest_pending_age_seconds": oldest.total_seconds() if oldest else None,
        "parked": counts.parked,
    }


async def _members(conn: Connection, places: Places, group: str) -> list[dict[str, Any]]:
    """The group's live members and the partitions each said it holds at its last beat, read
    as the group's own ``status()`` reads them."""
    return [
        {"member": member.name, "partitions": list(member.partitions)}
        for member in await admin(conn, places).members(group)
    ]


async def parked(
    conn: Connection, types: list[str], aggregates: list[str], after: str | None = None
) -> ParkedPage:
    """As ``parked list --type --aggregate``: any of the types, any of the aggregate ids; a
    page of ``SHOWN`` of them after the id ``after``, of which only the shown fields are
    read."""
    return await admin(conn).parked(types, aggregates, limit=SHOWN, after=after)


async def matching(conn: Connection, types: list[str], aggregates: list[str]) -> list[Any]:
    """The ids of every parked event the filters keep (none read whole), for a requeue."""
    return await admin(conn).matching(types, aggregates)


def parked_row(entry: ParkedEntry) -> dict[str, Any]:
    """What the page shows of a parked entry (not its payload): a field the entry holds in a
    type it cannot have is shown as stored, and the entry marked unreadable, with why."""
    raw = entry.document
    return {
        "_id": entry.event_id,
        "type": raw.get("type"),
        "aggregate_type": raw.get("aggregate_type"),
        "aggregate_id": entry.aggregate_id,
        "sequence": raw.get("sequence"),
        "attempts": entry.attempts,
        "last_error": entry.last_error,
        "unreadable": entry.unreadable,
    }


async def event(conn: Connection, event_id: str) -> dict[str, Any] | None:
    """An event's detail page: the entry of ``event_id`` read whole (None: the outbox holds
    none), its payload and headers as indented JSON, the headers as the broker gets them."""
    found = await admin(conn).event(event_id)
    if found is None:
        return None
    entry = found.summary
    return {
        **parked_row(entry),
        # An entry no relay tried yet may have no count (embedded mode writes none).
        "attempts": entry.document.get("attempts", 0),
        "version": entry.document.get("version"),
        "status": found.status,
        "occurred_at": found.occurred_at,
        "parked_at": found.parked_at,
        "collection": entry.collection,
        "payload": _pretty(found.payload),
        "headers": _pretty(found.headers),
        "broker_headers": (
            None if found.broker_headers is None else sorted(found.broker_headers.items())
        ),
    }


async def of_aggregate(conn: Connection, aggregate_id: str) -> list[dict[str, Any]]:
    """The events not yet published of the aggregate ``aggregate_id``: the first ``SHOWN``,
    of which only the shown fields are read."""
    return [listed_row(entry) for entry in await admin(conn).of_aggregate(aggregate_id, SHOWN)]


def listed_row(found: EventEntry) -> dict[str, Any]:
    return {
        **parked_row(found.summary),
        "attempts": found.summary.document.get("attempts", 0),
        "status": found.status,
        "occurred_at": found.occurred_at,
    }


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, default=str, ensure_ascii=False, sort_keys=True)


FAILED_FIELDS = ("consumer", "message_id", "event_type", "failed_at", "attempts", "last_error")


def failed_row(record: dict[str, Any]) -> dict[str, Any]:
    """What the page shows of a failed inbox message."""
    return {name: record.get(name) for name in FAILED_FIELDS}


async def inbox_failures(conn: Connection, places: Places) -> list[dict[str, Any]]:
    """The failed messages of every consumer, the latest first, at most ``SHOWN`` each."""
    records: list[dict[str, Any]] = []
    for consumer in await admin(conn, places).inbox_failures():
        box = Inbox(conn.db, consumer=consumer, collection=places.inbox)
        records += await box.failed(limit=SHOWN)
    return records


async def requeue_parked(conn: Connection, event_ids: list[str]) -> int:
    """As ``parked requeue``: the earlier parked events of their aggregates come back too."""
    return await admin(conn).requeue(event_ids)


async def requeue_failed(
    conn: Connection, places: Places, consumer: str, message_ids: list[str] | None
) -> int:
    """As ``inbox requeue``: these messages of the consumer, or (``None``) all its failed."""
    box = Inbox(conn.db, consumer=consumer, collection=places.inbox)
    if message_ids is None:
        return await box.requeue(all_failed=True)
    return await box.requeue(message_ids)


# -- the chart's samples ----------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    at: datetime
    pending: int
    parked: int
    published: int | None
    """Published since the previous sample (None for the first one, which has no previous)."""


class Sampler:
    """Samples the backlog every ``every`` seconds, keeping ``keep`` samples."""

    def __init__(self, conn: Connection, every: float, keep: int) -> None:
        self.conn = conn
        self.every = every
        self.samples: deque[Sample] = deque(maxlen=keep)
        self.last_error: str | None = None
        self._mark: datetime | None = None
        self._first = True

    def _published_entries(self) -> Any:
        outbox = self.conn.outbox
        return outbox.collection if outbox.mode == "collection" else outbox.event_ids

    async def _latest_expiry(self) -> datetime | None:
        latest = await self._published_entries().find_one(
            {"expire_at": {"$exists": True}}, sort=[("expire_at", -1)], projection={"expire_at": 1}
        )
        return latest.get("expire_at") if latest else None

    async def sample(self) -> Sample:
        backlog = await admin(self.conn).backlog()
        published: int | None = None
        latest = await self._latest_expiry()
        if not self._first:
            published = 0
            if latest is not None:
                since = {"$gt": self._mark} if self._mark is not None else {"$exists": True}
                published = int(
                    await self._published_entries().count_documents({"expire_at": since})
                )
        self._first = False
        self._mark = latest if latest is not None else self._mark
        taken = Sample(utc_now(), backlog.pending, backlog.parked, published)
        self.samples.append(taken)
        return taken

    async def run(self) -> None:
        """Sample until cancelled; a failed sample is logged and told on the page, not fatal."""
        while True:
            try:
                await self.sample()
                self.last_error = None
            except (OutboxError, PyMongoError) as error:
                self.last_error = one_line(error)
                log.warning("console: sampling failed: %s", self.last_error)
            await asyncio.sleep(self.every)

    def history(self) -> dict[str, Any]:
        return {
            "every_seconds": self.every,
            "error": self.last_error,
            "samples": [
                {
                    "at": s.at.isoformat(),
                    "pending": s.pending,
                    "parked": s.parked,
                    "published": s.published,
                }
                for s in self.samples
            ],
        }


@contextlib.asynccontextmanager
async def sampling(sampler: Sampler) -> Any:
    task = asyncio.create_task(sampler.run(), name="console-sampler")
    try:
        yield sampler
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
