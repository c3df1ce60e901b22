"""What the console shows, read through the outbox's admin (``mongo_outbox.admin``) as
``status``, ``parked list`` and ``inbox failed`` read it: one look at the outbox for each page,
and a sampler that keeps the last minutes of backlog and publishing for the chart.

How many events were published and parked between two samples, and by which relay, is
``OutboxAdmin.activity``: every published entry gets ``expire_at`` (its publication time plus
the retention, under the TTL index) and ``published_by`` (its relay's name), every parked one
``parked_at`` and ``parked_by``, so the counts since the previous sample are index ranges. The
relays' rates are those counts over the kept samples' seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pymongo.errors import PyMongoError

from mongo_outbox.admin import Activity, EventEntry, OutboxAdmin, ParkedEntry, ParkedPage
from mongo_outbox.cli.common import Connection, Target, one_line
from mongo_outbox.cli.status import gather
from mongo_outbox.errors import OutboxError
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


def activity_rows(
    report: dict[str, Any], rates: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """Every relay the database knows of, with its rates: the change-stream relays (their
    leases), the relay groups' live members (the rates of the partitions each holds), and the
    polling relays, which keep no record and are known only by the entries they settled in the
    kept samples (by name: two polling relays of one name are one row)."""
    rows: list[dict[str, Any]] = []
    known: set[str] = set()

    def rate(names: list[str], kind: str) -> float:
        return round(sum(rates.get(name, {}).get(kind, 0.0) for name in names), 3)

    for relay in report["relays"]:
        known.add(relay["name"])
        rows.append(
            {
                "name": relay["name"],
                "kind": "change stream",
                "state": relay["state"],
                "published_per_second": rate([relay["name"]], "published"),
                "parked_per_second": rate([relay["name"]], "parked"),
            }
        )
    for group in report["groups"]:
        names = [f"{group['name']}/{p['partition']}" for p in group["partitions"]]
        known.update(names)
        for member in group["members"]:
            held = [f"{group['name']}/{k}" for k in member["partitions"]]
            rows.append(
                {
                    "name": member["member"],
                    "kind": f"member of group {group['name']}",
                    "state": "active" if held else "standby",
                    "published_per_second": rate(held, "published"),
                    "parked_per_second": rate(held, "parked"),
                }
            )
    for name in sorted(set(rates) - known):
        rows.append(
            {
                "name": name or "(unnamed)",
                "kind": "polling",
                "state": "seen",
                "published_per_second": rate([name], "published"),
                "parked_per_second": rate([name], "parked"),
            }
        )
    return rows


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
    seconds: float | None
    """Seconds since the previous sample (None for the first one)."""
    published_by: Mapping[str, int]
    """Of those, how many each relay published, by its name."""
    parked_by: Mapping[str, int]
    """Entries each relay parked since the previous sample."""


class Sampler:
    """Samples the backlog and the relays' activity every ``every`` seconds, keeping ``keep``
    samples."""

    def __init__(self, conn: Connection, every: float, keep: int) -> None:
        self.conn = conn
        self.every = every
        self.samples: deque[Sample] = deque(maxlen=keep)
        self.last_error: str | None = None
        self._last: Activity | None = None

    async def sample(self) -> Sample:
        outbox = admin(self.conn)
        backlog = await outbox.backlog()
        activity = await outbox.activity(self._last)
        published = None if activity.published is None else sum(activity.published.values())
        seconds = None
        if self._last is not None:
            seconds = (activity.at - self._last.at).total_seconds()
        self._last = activity
        taken = Sample(
            activity.at,
            backlog.pending,
            backlog.parked,
            published,
            seconds,
            dict(activity.published or {}),
            dict(activity.parked or {}),
        )
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

    def rates(self) -> dict[str, dict[str, float]]:
        """Each relay's events published and parked per second over the kept samples, by the
        name it records: the counts of every sample after the first, over their seconds."""
        counted = [s for s in self.samples if s.seconds]
        seconds = sum(s.seconds or 0.0 for s in counted)
        rates: dict[str, dict[str, float]] = {}
        for sample in counted:
            for kind, by in (("published", sample.published_by), ("parked", sample.parked_by)):
                for name, n in by.items():
                    rates.setdefault(name, {"published": 0.0, "parked": 0.0})[kind] += n
        return {name: {kind: n / seconds for kind, n in of.items()} for name, of in rates.items()}

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
                    "per_second": (
                        None
                        if s.published is None or not s.seconds
                        else round(s.published / s.seconds, 3)
                    ),
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
