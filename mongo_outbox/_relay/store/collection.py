"""The relay's store for collection mode: one document per event in the outbox collection.

Round trips per round are constant: find + updateMany + find to claim, one bulkWrite to settle.
An entry is ``pending`` (due at ``available_at``, held while it carries a ``claim`` token),
``published`` (pruned by the TTL index after the outbox's retention) or ``parked``.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from pymongo import UpdateMany, UpdateOne

from mongo_outbox._codec import counter, decode, ours, read_for_relay, shown
from mongo_outbox._commands import chunked
from mongo_outbox._driver import aggregate
from mongo_outbox._partitions import partition_of
from mongo_outbox._relay.store.base import (
    RECHECK,
    Activity,
    Backlog,
    Claim,
    ParkedKey,
    PublishFailure,
    by,
    chunks,
    counts,
    hashable,
    scope,
    tolerant,
)
from mongo_outbox._storage import (
    ATTEMPTS,
    AVAILABLE_AT,
    CLAIM,
    EXPIRE_AT,
    LAST_ERROR,
    MISSES,
    PARKED,
    PARKED_AT,
    PARKED_BY,
    PENDING,
    PUBLISHED,
    PUBLISHED_AT,
    PUBLISHED_BY,
    SEQUENCES,
    STATUS,
    WAITING,
    WAITS,
)
from mongo_outbox.errors import InvalidEventError, describe
from mongo_outbox.events import Event, as_utc, utc_now
from mongo_outbox.outbox import Outbox

log = logging.getLogger("mongo_outbox.relay")

_AGGREGATE = {"aggregate_type": 1, "aggregate_id": 1, "sequence": 1}


class CollectionStore:
    def __init__(
        self, outbox: Outbox, partition: int | None = None, relay: str | None = None
    ) -> None:
        self.relay = relay
        self.retention = outbox.retention
        self.coll = ours(outbox.collection)
        self.entries = read_for_relay(outbox.collection)
        self.scope = scope(outbox, partition)
        self.partitions = outbox.partitions
        self._unique: bool | None = None

    async def claim(self, limit: int, lease: timedelta, until: datetime | None = None) -> Claim:
        now = utc_now()
        due = {
            **self.scope,
            STATUS: PENDING,
            AVAILABLE_AT: {"$lte": min(now, until or now)},
        }
        candidates = (
            await self.coll.find(due, projection=_AGGREGATE)
            .sort(AVAILABLE_AT, 1)
            .limit(limit)
            .to_list(None)
        )
        if not candidates:
            return Claim(uuid.uuid4().hex)
        claim, claimed = await self._claim(candidates, now, lease)
        return replace(claim, more=len(candidates) == limit or claimed < len(candidates))

    async def claim_changes(self, changes: Sequence[Mapping[str, Any]], lease: timedelta) -> Claim:
        entries = [
            c["fullDocument"]
            for c in changes
            if c.get("operationType") == "insert"
            and c.get("fullDocument")
            and all(c["fullDocument"].get(k) == v for k, v in self.scope.items())
        ]
        if not entries:
            return Claim(uuid.uuid4().hex)
        whole = _whole(entries) if await self._sequences_unique() else set()
        claim, _ = await self._claim(entries, utc_now(), lease, whole=whole)
        # Some failed before, wait behind an earlier entry, are another relay's, or were
        # published already (a replay after a restart): a sweep soon settles which.
        return replace(claim, more=claim.events < len(entries))

    async def _sequences_unique(self) -> bool:
        """Whether the outbox has its unique index of sequences (asked once): without it, an
        aggregate's sequence 1 may be stored twice, and changes holding one of them from
        sequence 1 on do not hold the aggregate whole."""
        if self._unique is None:
            indexes = await self.coll.index_information()
            index = indexes.get(SEQUENCES, {})
            self._unique = bool(index.get("unique"))
        return self._unique

    async def _claim(
        self,
        candidates: Sequence[Mapping[str, Any]],
        now: datetime,
        lease: timedelta,
        *,
        whole: set[tuple[Hashable, Hashable]] | None = None,
    ) -> tuple[Claim, int]:
        """Claim ``candidates`` and read what the claim holds. ``whole``: they are entries as
        inserted (a change stream's), and of these aggregates they hold every entry from
        sequence 1 on, so no other entry of theirs can go before them. If every candidate is
        claimed still fresh (never tried, held or woken: as inserted), the claim holds those
        as they are, and only the other aggregates are read (a round trip of every change's
        latency, when all are whole)."""
        token = uuid.uuid4().hex
        fresh = 0
        if whole:
            fresh = await self._claim_ids(candidates, token, now, lease, fresh_only=True)
            if fresh == len(candidates):
                known = [c for c in candidates if _aggregate(c) in whole]
                rest = [c for c in candidates if _aggregate(c) not in whole]
                mine = sorted(({**c, CLAIM: token} for c in known), key=lambda c: c["sequence"])
                ids = {c["_id"] for c in known}
                read = await self._pending(rest) if rest else []
                pending = mine + [entry for entry in read if entry["_id"] not in ids]
                return await self._held(pending, token, now), fresh
            # Some were tried or claimed since they were inserted: claimed as any are, and read.
        claimed = fresh + await self._claim_ids(candidates, token, now, lease, fresh_only=False)
        if not claimed:
            return Claim(token), 0
        return await self._held(await self._pending(candidates), token, now), claimed

    async def _claim_ids(
        self,
        candidates: Sequence[Mapping[str, Any]],
        token: str,
        now: datetime,
        lease: timedelta,
        *,
        fresh_only: bool,
    ) -> int:
        """Claim those of ``candidates`` that are due, or fresh; with ``fresh_only``, those
        still as they were inserted (``candidates`` are the inserted documents): fresh, and due
        when they were then (a requeue, a release or a new entry of a reused id changed it).
        How many it claimed."""
        fresh: dict[str, Any] = {CLAIM: None, ATTEMPTS: 0, WAITS: None, MISSES: None}
        claimed = 0
        for chunk in chunked(list(candidates)):
            if fresh_only:
                which: dict[str, Any] = {
                    "$or": [{"_id": c["_id"], AVAILABLE_AT: c[AVAILABLE_AT]} for c in chunk],
                    **fresh,
                }
            else:
                # A fresh entry is claimable whatever its writer's clock said; others when due.
                ids = [c["_id"] for c in chunk]
                which = {"_id": {"$in": ids}, "$or": [{AVAILABLE_AT: {"$lte": now}}, fresh]}
            result = await self.coll.update_many(
                {**self.scope, STATUS: PENDING, **which},
                {"$set": {AVAILABLE_AT: now + lease, CLAIM: token}},
            )
            claimed += result.modified_count
        return claimed

    async def _pending(self, candidates: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Every pending entry of the aggregates of ``candidates``, in sequence order."""
        # Every pending entry of the claimed aggregates up to the last one claimed, to find
        # entries that must go first (reading further would cost O(backlog) per round).
        last: dict[tuple[Hashable, Hashable], tuple[Any, Any, int | None]] = {}
        for c in candidates:
            t, i, seq = c.get("aggregate_type"), c.get("aggregate_id"), c.get("sequence")
            key = _aggregate(c)
            if key not in last or last[key][2] is not None:
                # No bound for an aggregate with an entry of no sequence (another producer's).
                before = last[key][2] or 0 if key in last else 0
                last[key] = (t, i, max(before, seq) if isinstance(seq, int) else None)
        pending: list[dict[str, Any]] = []
        for aggregates in chunked(list(last.values())):
            # Each aggregate is read whole by one command, so each is in sequence order.
            pending += (
                await self.entries.find(
                    {
                        STATUS: PENDING,
                        "$or": [
                            # $eq: a stored value is matched as itself, never as an operator.
                            {"aggregate_type": {"$eq": t}, "aggregate_id": {"$eq": i}}
                            | ({} if seq is None else {"sequence": {"$lte": seq}})
                            for t, i, seq in aggregates
                        ],
                    },
                    batch_size=10_000,
                )
                .sort("sequence", 1)
                .to_list(None)
            )
        return pending

    async def _held(self, pending: list[dict[str, Any]], token: str, now: datetime) -> Claim:
        """The claim ``token`` holds among ``pending`` (its aggregates' pending entries, in
        sequence order): parks what cannot be read, and releases what waits behind an entry it
        does not hold."""
        by_aggregate: dict[tuple[Hashable, Hashable], list[dict[str, Any]]] = defaultdict(list)
        for entry in pending:
            by_aggregate[_aggregate(entry)].append(entry)
        groups: list[tuple[Event, ...]] = []
        counters: dict[str, dict[str, int]] = {ATTEMPTS: {}, WAITS: {}, MISSES: {}}
        released: list[UpdateMany] = []
        unreadable: list[UpdateOne] = []
        for entries in by_aggregate.values():
            group: list[Event] = []
            blocker: dict[str, Any] | None = None
            behind: list[Any] = []
            for entry in entries:
                mine = entry.get(CLAIM) == token
                if not mine and not isinstance(entry.get(AVAILABLE_AT), datetime):
                    # Never due, so it would hold its aggregate back for ever.
                    why = "outbox entry has no available_at date"
                    unreadable.append(self._park(entry["_id"], entry.get(CLAIM), why))
                elif not mine:
                    # An earlier entry held by another relay, or backing off: ours must wait.
                    blocker = blocker or entry
                elif blocker is not None:
                    behind.append(entry["_id"])
                else:
                    try:
                        event = decode(entry, "_id")
                    except InvalidEventError as error:
                        # Parked on the spot: it can never be published, and must not stop
                        # the rest (its aggregate goes on without it, as after any park).
                        unreadable.append(self._park(entry["_id"], token, describe(error)))
                        continue
                    group.append(event)
                    for name, values in counters.items():
                        # A counter another writer stored as no whole number counts as none.
                        values[event.id] = counter(entry.get(name)) or 0
            if group:
                groups.append(tuple(group))
            if blocker is not None and behind:
                released += self._behind(blocker, behind, token, now)
        if unreadable or released:
            await tolerant(self.coll.bulk_write([*unreadable, *released], ordered=False))
        return Claim(
            token,
            tuple(groups),
            attempts=counters[ATTEMPTS],
            waits=counters[WAITS],
            misses=counters[MISSES],
            more=bool(unreadable),
        )

    @staticmethod
    def _behind(
        blocker: dict[str, Any], ids: list[Any], token: str, now: datetime
    ) -> list[UpdateMany]:
        """Release entries queued behind ``blocker``: until its backoff ends (and woken with it),
        or, while another relay holds it, for a second: a live holder publishes it at once."""
        due = max(as_utc(blocker[AVAILABLE_AT]), now)
        held = blocker.get(CLAIM) is not None
        return [
            UpdateMany(
                {"_id": {"$in": chunk}, CLAIM: token},
                {
                    "$set": {
                        AVAILABLE_AT: min(due, now + RECHECK) if held else due,
                        WAITING: bool(blocker.get(WAITING)) and not held,
                    },
                    "$unset": {CLAIM: ""},
                },
            )
            for chunk in chunked(ids)
        ]

    def _park(self, entry_id: Any, token: str | None, error: str) -> UpdateOne:
        parked = {PARKED_AT: utc_now(), PARKED_BY: self.relay}
        return UpdateOne(
            {"_id": {"$eq": entry_id}, STATUS: PENDING, CLAIM: token},
            {
                "$set": {STATUS: PARKED, LAST_ERROR: error, **parked},
                "$inc": {ATTEMPTS: 1},
                "$unset": {CLAIM: "", WAITING: ""},
            },
        )

    async def settle(
        self, claim: Claim, published: Sequence[Event], failed: Sequence[PublishFailure]
    ) -> None:
        now = utc_now()
        token = claim.token
        ops: list[Any] = []
        # One bulkWrite, whose ops each name a bounded number of ids: the driver splits a bulk
        # into commands of the server's size, but never one op.
        for ids in chunked([e.id for e in published]):
            ops.append(
                UpdateMany(
                    {"_id": {"$in": ids}},
                    {
                        "$set": {
                            STATUS: PUBLISHED,
                            PUBLISHED_AT: now,
                            PUBLISHED_BY: self.relay,
                            EXPIRE_AT: now + self.retention,
                        },
                        "$unset": {CLAIM: "", LAST_ERROR: "", WAITING: ""},
                    },
                )
            )
        for failure in failed:
            event = failure.event
            if failure.kind == "park":
                # Kept with its error for an operator, no longer holding its aggregate back.
                ops.append(self._park(event.id, token, failure.error))
                continue
            waiting = failure.kind == "wait" and failure.wake
            counter = ATTEMPTS
            if failure.kind == "wait":
                counter = WAITS if failure.wake else MISSES
            ops.append(
                # Conditional on our claim: a relay whose lease ran out must not move another's.
                UpdateOne(
                    {"_id": event.id, STATUS: PENDING, CLAIM: token},
                    {
                        "$set": {
                            AVAILABLE_AT: failure.retry_at,
                            LAST_ERROR: failure.error,
                            WAITING: waiting,
                        },
                        "$inc": {counter: 1},
                        "$unset": {CLAIM: ""},
                    },
                )
            )
            # What queues behind a failed entry waits as long (and is woken with it), so it is
            # not claimed in vain and the claim is not filled with entries that cannot go yet.
            ops.append(
                UpdateMany(
                    {
                        STATUS: PENDING,
                        "aggregate_type": event.aggregate_type,
                        "aggregate_id": event.aggregate_id,
                        "sequence": {"$gt": event.sequence},
                        CLAIM: {"$in": [token, None]},
                    },
                    {
                        "$set": {AVAILABLE_AT: failure.retry_at, WAITING: waiting},
                        "$unset": {CLAIM: ""},
                    },
                )
            )
        # Anything else still under this claim (a round cut short) becomes claimable at once.
        ops.append(
            UpdateMany(
                {CLAIM: token, STATUS: PENDING},
                {"$set": {AVAILABLE_AT: now}, "$unset": {CLAIM: ""}},
            )
        )
        await self.coll.bulk_write(ops, ordered=True)

    async def wake(self, limit: int | None = None) -> int:
        waiting = {**self.scope, STATUS: PENDING, WAITING: True, CLAIM: None}
        if limit is not None:
            ids = [
                d["_id"]
                for d in await self.coll.find(waiting, projection={"_id": 1})
                # The earliest, and of its aggregate the first: its followers wait with it.
                .sort([(AVAILABLE_AT, 1), ("sequence", 1)])
                .limit(limit)
                .to_list(None)
            ]
            waiting = {**waiting, "_id": {"$in": ids}}
        result = await self.coll.update_many(
            waiting, {"$set": {AVAILABLE_AT: utc_now(), WAITING: False}}
        )
        return int(result.modified_count)

    async def backlog(self) -> Backlog:
        pending = {**self.scope, STATUS: PENDING}
        oldest = await self.coll.find_one(
            pending, sort=[("occurred_at", 1)], projection={"occurred_at": 1}
        )
        at = oldest.get("occurred_at") if oldest else None
        count = await self.coll.count_documents(pending)
        return Backlog(count, at if isinstance(at, datetime) else None)

    async def assign_partitions(self, limit: int) -> int:
        if self.partitions == 1:
            return 0
        # None also matches a missing field; the group's index (partition, status, ...) has it.
        unassigned = {"partition": None, STATUS: PENDING}
        found = await self.coll.find(unassigned, projection=_AGGREGATE).limit(limit).to_list(None)
        ids: dict[int, list[Any]] = defaultdict(list)
        for entry in found:
            k = partition_of(
                entry.get("aggregate_type"), entry.get("aggregate_id"), self.partitions
            )
            ids[k].append(entry["_id"])
        if not ids:
            return 0
        # Entry by entry is safe for order: a claim waits behind an earlier pending entry of its
        # aggregate whatever that entry's partition, until it is assigned and published.
        result = await self.coll.bulk_write(
            [
                UpdateMany({"_id": {"$in": group}, **unassigned}, {"$set": {"partition": k}})
                for k, group in ids.items()
            ],
            ordered=False,
        )
        return int(result.modified_count)

    async def next_due(self) -> datetime | None:
        doc = await self.coll.find_one(
            {**self.scope, STATUS: PENDING},
            sort=[(AVAILABLE_AT, 1)],
            projection={AVAILABLE_AT: 1},
        )
        return as_utc(doc[AVAILABLE_AT]) if doc else None

    async def parked(
        self, event_ids: Sequence[Any] | None = None, fields: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        projection = dict.fromkeys(fields, 1) if fields else None
        # Projected, an entry is shown as read: the defaults of the fields left out would lie.
        listed = shown if projection is None else dict
        if event_ids is None:
            found = self.coll.find({STATUS: PARKED}, projection=projection).sort("_id", 1)
            return [listed(entry) async for entry in found]
        chosen: list[dict[str, Any]] = []
        for chunk in chunks(event_ids):
            asked = self.coll.find({"_id": {"$in": chunk}, STATUS: PARKED}, projection)
            chosen += [listed(entry) async for entry in asked]
        return sorted(chosen, key=lambda entry: str(entry["_id"]))

    async def parked_keys(self) -> list[ParkedKey]:
        found = self.coll.find({STATUS: PARKED}, projection={"type": 1, "aggregate_id": 1})
        return [ParkedKey.of(entry) async for entry in found.sort("_id", 1)]

    async def parked_count(self) -> int:
        return int(await self.coll.count_documents({STATUS: PARKED}))

    async def requeue(self, event_ids: Sequence[str]) -> int:
        requeued = 0
        for chunk in chunks(event_ids):
            requeued += await self._requeue(chunk)
        return requeued

    async def _requeue(self, event_ids: list[str]) -> int:
        asked = await self.coll.find(
            {"_id": {"$in": event_ids}, STATUS: PARKED},
            projection={**_AGGREGATE, "sequence": 1},
        ).to_list(None)
        if not asked:
            return 0
        # The latest asked-for sequence per aggregate: everything parked up to it comes back.
        latest: dict[tuple[Any, Any], Any] = {}
        for entry in asked:
            key = (entry.get("aggregate_type"), entry.get("aggregate_id"))
            latest[key] = max(
                latest.get(key, entry.get("sequence") or 0), entry.get("sequence") or 0
            )
        selectors = [
            {"aggregate_type": t, "aggregate_id": i, "sequence": {"$lte": s}}
            for (t, i), s in latest.items()
        ]
        # Each selector names its aggregate's id, which may be long (1,000 aggregates of 16 KB
        # ids made one command over 16 MiB): in commands of bounded size. An aggregate's
        # selector is whole in one of them, so its entries come back together, in order.
        requeued = 0
        for chosen in chunked(selectors):
            requeued += await self._unpark({"$or": chosen})
        # Then those no selector matched (an entry of another producer, without a sequence).
        for ids in chunked([e["_id"] for e in asked]):
            requeued += await self._unpark({"_id": {"$in": ids}})
        return requeued

    async def _unpark(self, chosen: dict[str, Any]) -> int:
        result = await self.coll.update_many(
            {STATUS: PARKED, **chosen},
            {
                "$set": {STATUS: PENDING, AVAILABLE_AT: utc_now(), ATTEMPTS: 0},
                "$unset": {WAITS: "", MISSES: "", WAITING: "", PARKED_AT: "", PARKED_BY: ""},
            },
        )
        return int(result.modified_count)

    async def activity(
        self, expired_after: datetime | None, parked_after: datetime | None
    ) -> Activity:
        latest = await self.coll.find_one(
            {EXPIRE_AT: {"$exists": True}}, sort=[(EXPIRE_AT, -1)], projection={EXPIRE_AT: 1}
        )
        mark = latest.get(EXPIRE_AT) if latest else None
        if parked_after is None:
            return Activity(mark)
        since = {"$gt": expired_after} if expired_after is not None else {"$exists": True}
        published = await aggregate(self.coll, [{"$match": {EXPIRE_AT: since}}, by(PUBLISHED_BY)])
        parked = await aggregate(
            self.coll,
            [{"$match": {STATUS: PARKED, PARKED_AT: {"$gt": parked_after}}}, by(PARKED_BY)],
        )
        return Activity(mark, counts(published), counts(parked))

    async def entry(self, event_id: Any) -> dict[str, Any] | None:
        found = await self.coll.find_one({"_id": {"$eq": event_id}})
        return None if found is None else shown(found)

    async def of_aggregates(
        self, aggregate_ids: Sequence[Any], fields: Sequence[str], limit: int
    ) -> list[dict[str, Any]]:
        query = {"aggregate_id": {"$in": list(aggregate_ids)}, STATUS: {"$ne": PUBLISHED}}
        projection = dict.fromkeys([*fields, STATUS, "occurred_at", PARKED_AT], 1)
        found = self.coll.find(query, projection=projection)
        found = found.sort([("aggregate_id", 1), ("sequence", 1)]).limit(limit)
        return [entry async for entry in found]

    async def published(
        self,
        since: datetime,
        until: datetime | None = None,
        types: Sequence[str] = (),
        aggregates: Sequence[Any] = (),
    ) -> AsyncIterator[Event]:
        occurred: dict[str, Any] = {"$gte": since}
        if until is not None:
            occurred["$lt"] = until
        query: dict[str, Any] = {STATUS: PUBLISHED, "occurred_at": occurred}
        if types:
            query["type"] = {"$in": list(types)}
        if aggregates:
            query["aggregate_id"] = {"$in": list(aggregates)}
        # The "aggregate" index gives this order without sorting in memory.
        entries = self.coll.find(query).sort(list(_AGGREGATE.items()))
        async for entry in entries:
            try:
                yield decode(entry, "_id")
            except InvalidEventError as error:  # rewritten by hand since it was published
                log.warning("skipping published entry %r: %s", entry.get("_id"), describe(error))


def _aggregate(entry: Mapping[str, Any]) -> tuple[Hashable, Hashable]:
    # Told apart by their hashable form: another producer's aggregate id may be a document (its
    # entries are parked, and must not stop everyone else's).
    return hashable(entry.get("aggregate_type")), hashable(entry.get("aggregate_id"))


def _whole(entries: Sequence[Mapping[str, Any]]) -> set[tuple[Hashable, Hashable]]:
    """The aggregates of a change stream's inserted ``entries`` that they hold whole: from
    sequence 1 on, with none missing (the unique index keeps sequences unique), so no other
    entry of theirs can go before them. None at all unless every entry reads as the relay reads
    entries (a plain dict, its dates datetimes), is numbered, and names its aggregate as the
    library does."""
    sequences: dict[tuple[Hashable, Hashable], list[int]] = defaultdict(list)
    for entry in entries:
        sequence = entry.get("sequence")
        t, i = entry.get("aggregate_type"), entry.get("aggregate_id")
        dates = (entry.get("occurred_at"), entry.get(AVAILABLE_AT))
        if type(entry) is not dict or type(sequence) is not int:
            return set()
        if not all(isinstance(date, datetime) for date in dates):
            return set()
        # Ids of one type each, as the library writes them: MongoDB and Python would match
        # others differently (1 and 1.0 are one id to both, True and 1 to Python alone).
        if type(t) is not str or type(i) not in (str, int):
            return set()
        sequences[(t, i)].append(sequence)
    return {key for key, seqs in sequences.items() if sorted(seqs) == list(range(1, len(seqs) + 1))}
