"""The relay's storage seam: how a relay claims pending events and records what happened to
them. Every outbox query of the relays goes through a ``Store``; the two modes implement it in
``store.collection`` and ``store.embedded``, and ``store_for`` (the package's face) picks one.

A claim is a lease and a value. ``claim`` marks entries (collection mode) or aggregate documents
(embedded mode) with a fresh token and a due time ``lease`` ahead, and returns a ``Claim`` that
holds everything the round needs; ``settle`` takes it back. The store keeps nothing between the
two, so any number of rounds, of one relay object or of many processes, can run at once. A relay
that dies lets its lease run out; the entries become claimable again and are published again,
under the same event id.

Failures come in three kinds: ``retry`` counts an attempt of the event, ``wait`` does not (the
broker was unavailable: the entry is flagged so ``wake`` can bring it forward once the broker is
back), ``park`` sets the entry aside with its error until an operator requeues it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, NamedTuple, Protocol, cast

import bson
from pymongo.errors import BulkWriteError

from mongo_outbox._commands import chunked
from mongo_outbox.events import Event
from mongo_outbox.outbox import Outbox

log = logging.getLogger("mongo_outbox.relay")

RECHECK = timedelta(seconds=1)
"""How soon an entry held back by another relay's claim is looked at again: a blocker held by
a live relay is usually published within milliseconds, and a dead one's lease is long."""

REQUEUE_CHUNK = 1000
"""How many event ids one requeue chunk names at most (fewer when the ids are long: a chunk is
also bounded in bytes, ``_commands.chunked``): a requeue of any size is a series of bounded
commands (one command naming 130k aggregates outgrew MongoDB's 16 MiB, and requeued nothing).
Each chunk brings back the earlier parked entries of its aggregates with it, so an aggregate's
order holds whatever chunk its entries fall in, and an interrupted requeue leaves whole chunks
requeued and the rest parked, for the same requeue to pick up again."""


def hashable(event_id: Any) -> Hashable:
    """``event_id`` as a set member: an id another producer stored as a document or an array
    (its entry parked as unreadable) stands for itself by its BSON form."""
    if type(event_id) is str:  # the usual id, asked for per entry claimed
        return event_id
    try:
        hash(event_id)
    except TypeError:
        return ("bson", bson.encode({"id": event_id}))
    return cast("Hashable", event_id)


async def tolerant(write: Awaitable[Any]) -> None:
    """Await a bulk write of per-entry fixes (parks, releases) made with ``ordered=False``: an
    op that one odd entry makes fail is logged, not raised, so that entry costs the round
    nothing but itself (it is met again at the next claim); the other ops were applied."""
    try:
        await write
    except BulkWriteError as error:
        failed = error.details.get("writeErrors") or error.details.get("writeConcernErrors") or []
        first = failed[0].get("errmsg") if failed else error
        log.warning("relay: %d of its writes for odd entries failed, first: %s", len(failed), first)


def chunks(ids: Sequence[Any], size: int | None = None) -> list[list[Any]]:
    """``ids`` without repeats, in slices of at most ``size`` (``REQUEUE_CHUNK``) ids and of
    bounded bytes (``_commands.chunked``): ids of another producer may be long."""
    size = size or REQUEUE_CHUNK
    unique = list({hashable(i): i for i in ids}.values())
    return [
        piece
        for start in range(0, len(unique), size)
        for piece in chunked(unique[start : start + size])
    ]


class ParkedKey(NamedTuple):
    """What a requeue by type or aggregate chooses a parked entry by, without reading it whole."""

    id: Any
    type: Any
    aggregate_id: Any

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> ParkedKey:
        """The key of an entry as ``Store.parked`` lists it."""
        return cls(entry.get("_id"), entry.get("type"), entry.get("aggregate_id"))

    def matches(self, types: Sequence[str], aggregates: Sequence[str]) -> bool:
        """As ``parked list --type --aggregate``: any of ``types``, any of ``aggregates``
        (aggregate ids as text, as an operator types them); no filter matches all."""
        if types and self.type not in types:
            return False
        return not aggregates or str(self.aggregate_id) in aggregates


@dataclass(frozen=True)
class Claim:
    """What one round holds: its token, the claimed events grouped per aggregate in sequence
    order, and what the store needs to settle them."""

    token: str
    groups: tuple[tuple[Event, ...], ...] = ()
    attempts: Mapping[str, int] = field(default_factory=dict)
    """Counted failed attempts of each claimed event so far, by event id."""
    waits: Mapping[str, int] = field(default_factory=dict)
    """Failures for want of a broker so far, by event id: its retry delay grows with them."""
    misses: Mapping[str, int] = field(default_factory=dict)
    """Failures for want of its destination (full, or missing) so far, by event id."""
    holders: Mapping[str, Any] = field(default_factory=dict)
    """Embedded mode: the (collection, document id) that holds each event."""
    positions: Mapping[str, int] = field(default_factory=dict)
    """Embedded mode: where each event's entry stood in its document's array when claimed. It
    stays there while the claim holds (writers only append, and only the claimer removes), and
    a document may hold one id twice (a copy saved into it), so settle acts by position."""
    held: tuple[Any, ...] = ()
    """Embedded mode: every document this claim holds (including ones with nothing to send)."""
    more: bool = False
    """Whether more may be claimable right now (or, for ``claim_changes``, whether some of the
    changes could not be claimed and deserve a look soon)."""

    @property
    def events(self) -> int:
        return sum(len(group) for group in self.groups)


Kind = Literal["retry", "wait", "park"]


@dataclass(frozen=True)
class PublishFailure:
    """What ``settle`` records of an event whose publish failed: its error, when it is due
    again, and which of the three kinds of failure it was."""

    event: Event
    error: str
    retry_at: datetime
    kind: Kind = "retry"
    wake: bool = False
    """For a ``wait``: the broker as a whole was unavailable, so the entry is woken once it
    confirms again. A full or missing destination is not: others' confirms say nothing of it,
    and it waits out its own growing delay (counted in ``misses``, not ``waits``)."""


@dataclass(frozen=True)
class Backlog:
    pending: int
    oldest: datetime | None
    """When the oldest pending event occurred."""


@dataclass(frozen=True)
class Activity:
    """What the relays did since an earlier look, as the entries tell: the latest ``expire_at``
    of a published entry (``mark``), and (None at a first look) how many entries each relay
    published since that look's mark and parked since its time, by the name the relay recorded
    (``""``: none recorded, an entry of an older version)."""

    mark: datetime | None
    published: Mapping[str, int] | None = None
    parked: Mapping[str, int] | None = None


def by(name: str) -> dict[str, Any]:
    """A ``$group`` stage counting entries by the relay named in field ``name``."""
    return {"$group": {"_id": f"${name}", "n": {"$sum": 1}}}


def counts(groups: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    found: dict[str, int] = {}
    for group in groups:
        key = "" if group["_id"] is None else str(group["_id"])
        found[key] = found.get(key, 0) + int(group["n"])
    return found


class Store(Protocol):
    async def claim(self, limit: int, lease: timedelta, until: datetime | None = None) -> Claim:
        """Lease up to ``limit`` entries due by ``until`` (default: now), grouped per aggregate.
        Entries that cannot be decoded are parked on the spot, with the reason."""

    async def claim_changes(self, changes: Sequence[Mapping[str, Any]], lease: timedelta) -> Claim:
        """Lease what these change-stream changes brought, under the same rules as ``claim``."""

    async def settle(
        self, claim: Claim, published: Sequence[Event], failed: Sequence[PublishFailure]
    ) -> None:
        """Mark ``published`` as published, apply ``failed`` (what queues behind a failure in
        its aggregate waits as long), and release whatever else ``claim`` holds."""

    async def wake(self, limit: int | None = None) -> int:
        """Make entries that wait for the broker due now (at most ``limit``); return how many."""

    async def backlog(self) -> Backlog: ...

    async def assign_partitions(self, limit: int) -> int:
        """Give up to ``limit`` pending entries that have no partition (saved before the
        outbox had partitions, or by a writer that checked the record before it existed) their
        aggregate's partition, so a relay group publishes them; return how many."""

    async def next_due(self) -> datetime | None:
        """When the earliest pending entry comes due (it may be in the past)."""

    async def parked(
        self, event_ids: Sequence[Any] | None = None, fields: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        """Parked entries, in id order (only those of ``event_ids`` when
        given): ``_id`` (the event id), the event's fields, ``status: "parked"``,
        ``attempts`` and ``last_error``. With ``fields``, only those are read (a projection:
        a listing does not read every parked payload whole)."""

    async def parked_keys(self) -> list[ParkedKey]:
        """Every parked entry's id, type and aggregate id, in id order: a requeue by type, by
        aggregate or of all chooses from these, so it never holds every parked entry whole."""

    async def parked_count(self) -> int: ...

    async def activity(
        self, expired_after: datetime | None, parked_after: datetime | None
    ) -> Activity:
        """The latest ``expire_at`` of a published entry; unless ``parked_after`` is None,
        with the entries published since (whose ``expire_at`` is past ``expired_after``, all of
        them when None) and parked since ``parked_after``, counted by relay: index ranges over
        the TTL index and the parked entries."""

    async def entry(self, event_id: Any) -> dict[str, Any] | None:
        """The entry of ``event_id`` read whole, as ``parked`` lists one, with its ``status``
        (``pending``, ``parked``; in collection mode also ``published`` while it is kept) and
        ``parked_at``; None when the outbox holds no entry of that id."""

    async def of_aggregates(
        self, aggregate_ids: Sequence[Any], fields: Sequence[str], limit: int
    ) -> list[dict[str, Any]]:
        """The first ``limit`` entries not yet published (pending or parked) of these
        aggregate ids, by aggregate and in its order, with only ``fields`` (and ``status``,
        ``occurred_at``, ``parked_at``) read."""

    async def requeue(self, event_ids: Sequence[str]) -> int:
        """Make these parked entries due again with no attempts counted, together with the
        earlier parked entries of their aggregates (a requeued event must not overtake them);
        return how many. Any number of ids, in chunks (``chunks``) of commands of bounded
        size, whatever the length of the ids and of their aggregates' ids."""

    def published(
        self,
        since: datetime,
        until: datetime | None = None,
        types: Sequence[str] = (),
        aggregates: Sequence[Any] = (),
    ) -> AsyncIterator[Event]:
        """Events already published and still kept (within the outbox's retention) that
        occurred at or after ``since`` (and before ``until``), of ``types`` and
        ``aggregates`` (their ``aggregate_id``) when given, sorted by aggregate and then
        sequence. Embedded mode keeps no published entries: ``UsageError``."""


def scope(outbox: Outbox, partition: int | None) -> dict[str, Any]:
    """The filter that narrows a store's queries to ``partition`` (none with one partition)."""
    if partition is None or outbox.partitions == 1:
        return {}
    return {outbox.partition_field: partition}
