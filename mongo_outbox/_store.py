"""The relay's storage seam: how a relay claims pending events and records what happened to
them. Every outbox query of the relays goes through a ``Store``; the two modes implement it in
``_collection_store`` and ``_embedded_store``.

A claim is a lease and a value. ``claim`` marks entries (collection mode) or aggregate documents
(embedded mode) with a fresh token and a due time ``lease`` ahead, and returns a ``Claim`` that
holds everything the round needs; ``settle`` takes it back. The store keeps nothing between the
two, so any number of rounds, of one relay object or of many processes, can run at once. A relay
that dies lets its lease run out; the entries become claimable again and are published again,
under the same event id.

Failures come in three kinds: ``retry`` counts an attempt of the event, ``wait`` does not (the
broker was unavailable: the entry is flagged so ``wake`` can bring it forward once the broker is
back), ``park`` sets the entry aside as dead-lettered with its error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

from mongo_outbox.events import Event
from mongo_outbox.outbox import Outbox

RECHECK = timedelta(seconds=1)
"""How soon an entry held back by another relay's claim is looked at again: a blocker held by
a live relay is usually published within milliseconds, and a dead one's lease is long."""

REQUEUE_BATCH = 1000
"""How many event ids one requeue command names at most: a requeue of any size is a series of
bounded commands (one command naming 130k aggregates outgrew MongoDB's 16 MiB, and requeued
nothing). Each batch brings back the earlier parked entries of its aggregates with it, so an
aggregate's order holds whatever batch its entries fall in, and an interrupted requeue leaves
whole batches requeued and the rest parked, for the same requeue to pick up again."""


def batches(ids: Sequence[Any], size: int | None = None) -> list[list[Any]]:
    """``ids`` without repeats, in slices of at most ``size`` (``REQUEUE_BATCH``)."""
    size = size or REQUEUE_BATCH
    unique = list(dict.fromkeys(ids))
    return [unique[start : start + size] for start in range(0, len(unique), size)]


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
class Failure:
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


class Store(Protocol):
    async def claim(self, limit: int, lease: timedelta, until: datetime | None = None) -> Claim:
        """Lease up to ``limit`` entries due by ``until`` (default: now), grouped per aggregate.
        Entries that cannot be decoded are parked on the spot, with the reason."""

    async def claim_changes(self, changes: Sequence[Mapping[str, Any]], lease: timedelta) -> Claim:
        """Lease what these change-stream changes brought, under the same rules as ``claim``."""

    async def settle(
        self, claim: Claim, published: Sequence[Event], failed: Sequence[Failure]
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

    async def parked(self) -> list[dict[str, Any]]:
        """Entries parked as dead-lettered: ``_id`` (the event id), the event's fields,
        ``status: "parked"``, ``attempts`` and ``last_error``."""

    async def parked_count(self) -> int: ...

    async def requeue(self, event_ids: Sequence[str]) -> int:
        """Make these parked entries due again with no attempts counted, together with the
        earlier parked entries of their aggregates (a requeued event must not overtake them);
        return how many. Any number of ids, in commands of ``REQUEUE_BATCH`` ids at most."""

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


def store_for(outbox: Outbox, partition: int | None = None) -> Store:
    """The store of ``outbox``; with ``partition``, one that claims, wakes and counts that
    partition's entries only (a relay group member's view)."""
    from mongo_outbox._collection_store import CollectionStore
    from mongo_outbox._embedded_store import EmbeddedStore

    if outbox.mode == "embedded":
        return EmbeddedStore(outbox, partition)
    return CollectionStore(outbox, partition)


def scope(outbox: Outbox, partition: int | None) -> dict[str, Any]:
    """The filter that narrows a store's queries to ``partition`` (none with one partition)."""
    if partition is None or outbox.partitions == 1:
        return {}
    return {outbox.partition_field: partition}
