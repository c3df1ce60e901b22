"""One public way to operate an outbox: what the command line, the web console and users'
scripts read and change of it, as typed records.

An operator's tool that queried the stores itself would be a second copy of the storage layout
(two modes, wrapped unreadable entries, checkpoint fields), drifting from the relays' own. So
``OutboxAdmin`` goes through the relays' storage seam, as ``PollingRelay.parked()`` and
``requeue()`` do (they delegate here), and needs no publisher: a database and the outbox's
settings are enough.

Listings read only what they show: ``parked()`` chooses entries by their keys (id, type,
aggregate id), then reads a page of them (``limit`` entries ``after`` an id) with a projection
of the fields a ``ParkedEntry`` holds; ``whole=True`` reads them whole. An entry whose fields
another producer or a manual fix left in the wrong types is listed, marked ``unreadable`` with
the reason, never raised on.

One event is read whole by its id (``event()``), whatever its state; an aggregate's events not
yet published are listed by its id (``of_aggregate()``), their ``SUMMARY`` fields only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from bson import ObjectId

from mongo_outbox._codec import decode
from mongo_outbox._inbox.store import failures
from mongo_outbox._relay.group.members import Membership
from mongo_outbox._relay.replay import replay
from mongo_outbox._relay.store import store_for
from mongo_outbox._relay.store.base import ParkedKey, chunks
from mongo_outbox._storage import (
    ATTEMPTS,
    CHECKPOINT_AT,
    EXPIRE_AT,
    HOLDER_COLLECTION,
    LAST_ERROR,
    LEASE_UNTIL,
    OWNER,
)
from mongo_outbox.brokers._publishing import Publisher, message_headers
from mongo_outbox.errors import InvalidEventError
from mongo_outbox.events import as_utc, utc_now
from mongo_outbox.outbox import Outbox
from mongo_outbox.settings import RelaySettings
from mongo_outbox.status import Replayed

__all__ = [
    "SUMMARY",
    "Activity",
    "Backlog",
    "EventEntry",
    "Lease",
    "Member",
    "OutboxAdmin",
    "ParkedEntry",
    "ParkedPage",
    "Replayed",
]

SUMMARY = (
    "_id",
    "type",
    "version",
    "aggregate_type",
    "aggregate_id",
    "sequence",
    ATTEMPTS,
    LAST_ERROR,
    HOLDER_COLLECTION,
)
"""The fields of a parked entry a listing reads (its payload and metadata are left out)."""


@dataclass(frozen=True)
class Activity:
    """What the relays did between an earlier look and this one (``at``), as the entries they
    settled record it: how many each relay published and parked, by the name the relay runs
    under (``""``: an entry settled by a version that recorded no name). ``None`` at a first
    look, which only takes its marks."""

    at: datetime
    mark: datetime | None
    """The latest ``expire_at`` of a published entry: what the next look counts past."""
    published: Mapping[str, int] | None
    parked: Mapping[str, int] | None


@dataclass(frozen=True)
class Backlog:
    """The outbox's pending entries, when the oldest occurred, and how many are parked."""

    pending: int
    oldest: datetime | None
    parked: int

    def oldest_age(self, now: datetime | None = None) -> timedelta | None:
        """How long the oldest pending event has waited (None: nothing pending)."""
        return None if self.oldest is None else (now or utc_now()) - as_utc(self.oldest)


@dataclass(frozen=True)
class ParkedEntry:
    """A parked entry as an operator reads it: the event's keys, its attempts and last error.

    A field stored in a type this library cannot read (a ``sequence`` of ``"x"``) is ``None``
    here, and ``unreadable`` says why; ``document`` holds the entry as read (whole, or the
    ``SUMMARY`` fields of a listing), ``_id`` being the event id."""

    event_id: Any
    type: str | None
    aggregate_type: str | None
    aggregate_id: Any
    sequence: int | None
    version: int | None
    attempts: int | None
    last_error: str | None
    collection: str | None
    """Embedded mode: the aggregate collection whose document holds the entry."""
    unreadable: str | None
    """Why the entry cannot be read as an event (None: it can)."""
    document: Mapping[str, Any] = field(repr=False)

    @classmethod
    def of(cls, document: Mapping[str, Any]) -> ParkedEntry:
        """The record of an entry as the store lists it; never raises."""
        problems: list[str] = []

        def typed(name: str, kind: type, default: Any = None, low: int | None = None) -> Any:
            value = document.get(name, default)
            if value is None and default is None:
                return None
            wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
            if wrong or (low is not None and value < low):
                problems.append(f"{name} {value!r} is not {_KINDS[kind, low]}")
                return None
            return value

        entry = cls(
            event_id=document.get("_id"),
            type=typed("type", str),
            aggregate_type=typed("aggregate_type", str),
            aggregate_id=document.get("aggregate_id"),
            # An entry without a sequence cannot be put in order; without a version, it is
            # published as version 1 (Event's default).
            sequence=typed("sequence", int, low=1),
            version=typed("version", int, 1, low=1),
            attempts=typed(ATTEMPTS, int),
            last_error=None if document.get(LAST_ERROR) is None else str(document[LAST_ERROR]),
            collection=typed(HOLDER_COLLECTION, str),
            unreadable=None,
            document=document,
        )
        if document.get("sequence") is None:
            problems.append("it has no sequence")
        if "entry" in document:
            problems.insert(0, f"its stored entry is not a document: {document['entry']!r}")
        if problems:
            return replace(entry, unreadable="; ".join(problems))
        return entry


@dataclass(frozen=True)
class EventEntry:
    """An event the outbox holds, as its detail page shows it: ``summary`` holds its keys,
    attempts and last error (a ``ParkedEntry``, whatever its state), and the rest what only a
    read of the whole entry tells (``None`` in a listing, which reads the ``SUMMARY``
    fields only)."""

    summary: ParkedEntry
    status: str | None
    """``pending``, ``parked``, or (collection mode, while the outbox keeps it) ``published``."""
    occurred_at: datetime | None
    parked_at: datetime | None
    """When the relay parked it (None: not parked, or parked by a version that did not say)."""
    payload: Any
    headers: Mapping[str, Any] | None
    """The event's own headers, as stored."""
    broker_headers: Mapping[str, str] | None
    """The headers a broker gets with the message (the event's own, then the routing ones);
    None for an entry that cannot be read as an event (``summary.unreadable``)."""

    @property
    def event_id(self) -> Any:
        return self.summary.event_id

    @classmethod
    def of(cls, document: Mapping[str, Any], whole: bool = True) -> EventEntry:
        """The record of an entry as the store reads it; never raises."""
        summary = ParkedEntry.of(document)
        broker: dict[str, str] | None = None
        if whole and summary.unreadable is None:
            try:
                broker = message_headers(decode(dict(document), "_id"))
            except (InvalidEventError, ValueError) as error:
                summary = replace(summary, unreadable=str(error))
        headers = document.get("headers")
        return cls(
            summary=summary,
            status=None if document.get("status") is None else str(document["status"]),
            occurred_at=_date(document.get("occurred_at")),
            parked_at=_date(document.get("parked_at")),
            payload=document.get("payload") if whole else None,
            headers=(headers if isinstance(headers, Mapping) else None) if whole else None,
            broker_headers=broker,
        )


_KINDS = {
    (str, None): "text",
    (int, None): "a whole number",
    (int, 1): "a whole number from 1",
}


@dataclass(frozen=True)
class ParkedPage:
    """One page of parked entries, in event id order."""

    entries: tuple[ParkedEntry, ...]
    total: int
    """Parked entries in all."""
    matching: int
    """Those the filters keep (all of them without filters)."""
    types: tuple[str, ...]
    """The event types of every parked entry, for a filter to offer."""
    next_after: str | None
    """Pass as ``after`` for the next page; None on the last one."""


@dataclass(frozen=True)
class Lease:
    """A change-stream relay's (or a relay group partition's) record: who holds its lease,
    until when, and its checkpoint's time. Polling relays keep none."""

    name: str
    holder: str | None
    """The holder, while the lease is held (``held``); None once it ran out or was given up."""
    until: datetime | None
    checkpoint_at: datetime | None
    held: bool
    """Whether the lease runs now: a relay that stopped gave it up, one that died lets it run
    out. Not the relay's own ``State``, which only the relay's process knows."""

    @property
    def group(self) -> str | None:
        """The relay group of a partition's lease (``group/partition``); None otherwise."""
        group, _, number = self.name.rpartition("/")
        return group if group and number.isdigit() else None

    @property
    def partition(self) -> int | None:
        group, _, number = self.name.rpartition("/")
        return int(number) if group and number.isdigit() else None


@dataclass(frozen=True)
class Member:
    """A live member of a relay group and the partitions it said it holds at its last beat."""

    name: str
    partitions: tuple[int, ...]


class OutboxAdmin:
    """Reads and operations on ``outbox`` for operators.

    Args:
        outbox: the outbox, as its writers and relays are configured.
        checkpoints: the change-stream relays' checkpoint (and lease) collection.
        inbox: the inbox collection, in the outbox's database.
        members: the relay groups' heartbeat collection.
    """

    def __init__(
        self,
        outbox: Outbox,
        *,
        checkpoints: str = "outbox_relays",
        inbox: str = "inbox",
        members: str = "outbox_relay_members",
    ) -> None:
        self.outbox = outbox
        self._store = store_for(outbox)
        self._checkpoints = outbox.db[checkpoints]
        self._inbox = outbox.db[inbox]
        self._members = outbox.db[members]

    async def backlog(self) -> Backlog:
        counts = await self._store.backlog()
        return Backlog(counts.pending, counts.oldest, await self._store.parked_count())

    def _published(self) -> Any:
        # What a settle marks published with an expiry: the outbox's entries (collection mode)
        # or the id registry's (embedded mode), until the TTL index prunes them.
        outbox = self.outbox
        return outbox.collection if outbox.mode == "collection" else outbox.event_ids

    async def latest_publication(self) -> datetime | None:
        """The expiry of the entry published last (None: none is kept): a mark to count the
        publications after, with ``published_after``."""
        latest = await self._published().find_one(
            {EXPIRE_AT: {"$exists": True}}, sort=[(EXPIRE_AT, -1)], projection={EXPIRE_AT: 1}
        )
        return latest.get(EXPIRE_AT) if latest else None

    async def published_after(self, mark: datetime | None) -> int:
        """How many kept entries were published after ``mark`` (a ``latest_publication``),
        or in all when ``mark`` is None; pruned ones are not counted."""
        since = {"$gt": mark} if mark is not None else {"$exists": True}
        return int(await self._published().count_documents({EXPIRE_AT: since}))

    async def parked(
        self,
        types: Sequence[str] = (),
        aggregates: Sequence[str] = (),
        *,
        limit: int | None = None,
        after: str | None = None,
        whole: bool = False,
    ) -> ParkedPage:
        """Parked entries of any of ``types`` and any of ``aggregates`` (ids as text; none:
        all), in id order: the first ``limit`` (None: all) of those whose id comes ``after``
        this one (ids compared as text, as the page's ``next_after`` is; a page takes every id
        of its last one's text, so it may hold a few more than ``limit``). Only their
        ``SUMMARY`` fields are read, unless ``whole``."""
        fields = None if whole else SUMMARY
        if not types and not aggregates and limit is None and after is None:
            # Every one of them: one read, not their keys first.
            every = [ParkedEntry.of(e) for e in await self._store.parked(None, fields)]
            kinds = {str(e.document.get("type")) for e in every}
            return ParkedPage(tuple(every), len(every), len(every), tuple(sorted(kinds)), None)
        keys = sorted(await self._store.parked_keys(), key=lambda key: str(key.id))
        chosen = [key.id for key in keys if key.matches(types, aggregates)]
        rest = chosen if after is None else [i for i in chosen if str(i) > after]
        ids = rest if limit is None else rest[:limit]
        # The next page starts past ids[-1]'s text: a page never ends between two ids of one
        # text (an ObjectId and its hex string, from two producers), or the next skips one.
        while ids and len(ids) < len(rest) and str(rest[len(ids)]) == str(ids[-1]):
            ids.append(rest[len(ids)])
        found = await self._store.parked(ids, fields) if ids else []
        # By id, the store lists every parked entry of those ids: the filters again, for an id
        # parked in two documents.
        entries = [e for e in found if ParkedKey.of(e).matches(types, aggregates)]
        more = len(rest) > len(ids)
        return ParkedPage(
            entries=tuple(ParkedEntry.of(entry) for entry in entries),
            total=len(keys),
            matching=len(chosen),
            types=tuple(sorted({str(key.type) for key in keys})),
            next_after=str(ids[-1]) if more and ids else None,
        )

    async def parked_entries(self, event_ids: Sequence[Any]) -> list[ParkedEntry]:
        """These parked entries, read whole (ids that are not parked are left out)."""
        return [ParkedEntry.of(entry) for entry in await self._store.parked(list(event_ids))]

    async def activity(self, since: Activity | None = None) -> Activity:
        """The relays' publishes and parks since the look ``since`` (None: a first look, which
        counts nothing). Published entries are those whose ``expire_at`` (publication time plus
        the retention, under the TTL index) is past the latest one ``since`` saw: exact as long
        as the retention stays the same. Parked ones are those parked after ``since.at``."""
        at = utc_now()
        if since is None:
            found = await self._store.activity(None, None)
        else:
            found = await self._store.activity(since.mark, since.at)
        mark = found.mark if found.mark is not None else (since.mark if since else None)
        return Activity(at, mark, found.published, found.parked)

    async def event(self, event_id: str) -> EventEntry | None:
        """The entry of ``event_id``, read whole; None when the outbox holds none."""
        found = await self._store.entry(event_id)
        return None if found is None else EventEntry.of(found)

    async def of_aggregate(self, aggregate_id: str, limit: int = 200) -> list[EventEntry]:
        """The first ``limit`` events not yet published (pending and parked) of the aggregate
        whose id is ``aggregate_id`` as text (stored as that text, that whole number, or that
        ObjectId), in its order; only their ``SUMMARY`` fields are read."""
        found = await self._store.of_aggregates(_ids_of(aggregate_id), SUMMARY, limit)
        return [EventEntry.of(entry, whole=False) for entry in found]

    async def matching(
        self, types: Sequence[str] = (), aggregates: Sequence[str] = ()
    ) -> list[Any]:
        """The ids of the parked entries ``parked(types, aggregates)`` lists, without reading
        any entry whole: what a requeue by type or aggregate requeues."""
        keys = await self._store.parked_keys()
        return [key.id for key in keys if key.matches(types, aggregates)]

    async def requeue(
        self, event_ids: Sequence[Any], progress: Callable[[int], None] | None = None
    ) -> int:
        """Make these parked entries due again, with a fresh set of attempts, together with
        the earlier parked entries of their aggregates, so none overtakes another; return how
        many. In chunks of bounded commands, ``progress(n)`` told of each chunk's ``n`` ids:
        interrupted, the whole chunks done are requeued and the rest still parked."""
        requeued = 0
        for chunk in chunks(event_ids):
            requeued += await self._store.requeue(chunk)
            if progress is not None:
                progress(len(chunk))
        return requeued

    async def replay(
        self,
        connect: Callable[[], Awaitable[Publisher]] | None,
        *,
        since: datetime,
        until: datetime | None = None,
        types: Sequence[str] = (),
        aggregates: Sequence[Any] = (),
        settings: RelaySettings | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Replayed:
        """Republish the published events the outbox still keeps (collection mode) that
        occurred since ``since``, through the publisher ``connect()`` returns (None: only
        count them); see ``mongo-outbox replay``."""
        return await replay(
            self.outbox,
            connect,
            since=since,
            until=until,
            types=types,
            aggregates=aggregates,
            settings=settings,
            progress=progress,
        )

    async def leases(self) -> list[Lease]:
        """Every change-stream relay's and relay group partition's record, by name."""
        now = utc_now()
        found: list[Lease] = []
        async for doc in self._checkpoints.find().sort("_id", 1):
            until = _date(doc.get(LEASE_UNTIL))
            held = until is not None and until > now
            owner = doc.get(OWNER)
            found.append(
                Lease(
                    name=str(doc["_id"]),
                    holder=str(owner) if held and owner is not None else None,
                    until=until,
                    checkpoint_at=_date(doc.get(CHECKPOINT_AT)),
                    held=held,
                )
            )
        return found

    async def partitions(self) -> int:
        """The outbox's recorded partition count (1 when none is recorded)."""
        config = await self.outbox.config.find_one({"_id": "partitions"})
        count = config.get("count", 1) if config else 1
        return count if isinstance(count, int) and count > 0 else 1

    async def members(self, group: str) -> list[Member]:
        """Relay group ``group``'s live members, by name."""
        beats = Membership(self._members, group, me="", lease=timedelta(0))
        return [
            Member(str(doc["_id"]), tuple(int(k) for k in doc.get("partitions") or ()))
            for doc in await beats.live()
        ]

    async def inbox_failures(self) -> dict[str, int]:
        """How many messages each consumer of the inbox has dead-lettered, by consumer."""
        return await failures(self._inbox)


def _ids_of(text: str) -> list[Any]:
    """The stored ids an operator means by ``text``: itself, and the number or ObjectId it
    spells."""
    ids: list[Any] = [text]
    if text.lstrip("-").isdigit() and len(text) < 20:
        ids.append(int(text))
    if ObjectId.is_valid(text):
        ids.append(ObjectId(text))
    return ids


def _date(value: Any) -> datetime | None:
    return as_utc(value) if isinstance(value, datetime) else None
