"""How a relay claims pending events and records what happened to them, for each outbox mode.

A claim is a lease: entries (collection mode) or aggregate documents (embedded mode) get a claim
token and an ``available_at``/due time in the future. A relay that dies simply lets its lease run
out; the entries become claimable again and are published again, under the same event id.

Round trips per batch are constant: collection mode claims with find + updateMany + find, embedded
mode with find + updateMany + find per collection, and both settle with one bulkWrite.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from pymongo import UpdateMany, UpdateOne

from mongo_outbox.events import Event, as_utc, utc_now
from mongo_outbox.outbox import Outbox

_EVENT_FIELDS = frozenset(Event.model_fields)
_RECHECK = timedelta(seconds=1)


@dataclass
class Failure:
    event: Event
    error: str
    retry_at: datetime
    park: bool = False  # out of attempts: set aside as dead-lettered, not retried
    counted: bool = True  # False when the broker was unavailable: not an attempt of the event


class Store(Protocol):
    attempts: dict[str, int]
    """Earlier failed attempts of each claimed event, by event id."""

    async def claim(
        self, limit: int, lease: timedelta, until: datetime | None = None
    ) -> tuple[list[list[Event]], bool]:
        """Lease up to ``limit`` entries due by ``until`` (default: now). Returns them grouped per
        aggregate in sequence order, and whether more may be claimable right now."""

    async def settle(self, published: Sequence[Event], failed: Sequence[Failure]) -> None:
        """Mark ``published`` as published and push ``failed`` (and what queues behind them in
        their aggregate) back to their retry time; release whatever else this relay claimed."""

    async def parked(self) -> list[dict[str, Any]]:
        """Entries parked as dead-lettered: ``_id`` (the event id), the event's fields,
        ``status: "parked"``, ``attempts`` and ``last_error``."""

    async def requeue(self, event_ids: Sequence[str]) -> int:
        """Make these parked entries due again with no attempts counted; return how many."""


def store_for(outbox: Outbox) -> Store:
    if outbox.mode == "embedded":
        return EmbeddedStore(outbox)
    return CollectionStore(outbox)


def decode(entry: dict[str, Any], id_key: str) -> Event:
    data = {k: v for k, v in entry.items() if k in _EVENT_FIELDS}
    data["id"] = entry[id_key]
    at = data.get("occurred_at")
    if isinstance(at, datetime) and at.tzinfo is None:
        data["occurred_at"] = at.replace(tzinfo=timezone.utc)
    return Event.model_validate(data)


class CollectionStore:
    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.coll = outbox.collection
        self.token = ""
        self.attempts: dict[str, int] = {}

    async def claim(
        self, limit: int, lease: timedelta, until: datetime | None = None
    ) -> tuple[list[list[Event]], bool]:
        now = utc_now()
        self.token = uuid.uuid4().hex
        self.attempts = {}
        due = {"status": "pending", "available_at": {"$lte": min(now, until or now)}}
        candidates = (
            await self.coll.find(due, projection={"aggregate_type": 1, "aggregate_id": 1})
            .sort("available_at", 1)
            .limit(limit)
            .to_list(None)
        )
        if not candidates:
            return [], False
        groups, claimed = await self._claim(candidates, now, lease)
        return groups, len(candidates) == limit or claimed < len(candidates)

    async def claim_entries(
        self, entries: Sequence[dict[str, Any]], lease: timedelta
    ) -> list[list[Event]]:
        """Lease these entries (``_id``, ``aggregate_type``, ``aggregate_id``), e.g. just seen on
        a change stream, under the same order rule as ``claim``."""
        self.token = uuid.uuid4().hex
        self.attempts = {}
        groups, _ = await self._claim(entries, utc_now(), lease)
        return groups

    async def _claim(
        self, candidates: Sequence[dict[str, Any]], now: datetime, lease: timedelta
    ) -> tuple[list[list[Event]], int]:
        claimed = await self.coll.update_many(
            {
                "_id": {"$in": [c["_id"] for c in candidates]},
                "status": "pending",
                # A fresh entry is claimable whatever the writer's clock said; others when due.
                "$or": [{"available_at": {"$lte": now}}, {"claim": None, "attempts": 0}],
            },
            {"$set": {"available_at": now + lease, "claim": self.token}},
        )
        if not claimed.modified_count:
            return [], 0
        aggregates = {(c["aggregate_type"], c["aggregate_id"]) for c in candidates}
        # Every pending entry of the claimed aggregates, to find entries that must go first.
        pending = (
            await self.coll.find(
                {
                    "status": "pending",
                    "$or": [{"aggregate_type": t, "aggregate_id": i} for t, i in aggregates],
                },
                batch_size=10_000,
            )
            .sort("sequence", 1)
            .to_list(None)
        )
        by_aggregate: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
        for entry in pending:
            by_aggregate[(entry["aggregate_type"], entry["aggregate_id"])].append(entry)
        groups: list[list[Event]] = []
        blocked: dict[datetime, list[Any]] = defaultdict(list)
        for entries in by_aggregate.values():
            group: list[Event] = []
            blocker: dict[str, Any] | None = None
            for entry in entries:
                if entry.get("claim") != self.token:
                    # An earlier entry held by another relay, or backing off: ours must wait.
                    blocker = blocker or entry
                elif blocker is None:
                    group.append(decode(entry, "_id"))
                    self.attempts[entry["_id"]] = entry.get("attempts", 0)
                else:
                    # Until the blocker's lease or backoff ends, but at most a second: a
                    # blocker held by a live relay is usually published within milliseconds.
                    again = min(max(as_utc(blocker["available_at"]), now), now + _RECHECK)
                    blocked[again].append(entry["_id"])
            if group:
                groups.append(group)
        if blocked:
            await self.coll.bulk_write(
                [
                    UpdateMany(
                        {"_id": {"$in": ids}, "claim": self.token},
                        {"$set": {"available_at": at}, "$unset": {"claim": ""}},
                    )
                    for at, ids in blocked.items()
                ],
                ordered=False,
            )
        return groups, claimed.modified_count

    async def settle(self, published: Sequence[Event], failed: Sequence[Failure]) -> None:
        now = utc_now()
        ops: list[Any] = []
        if published:
            ops.append(
                UpdateMany(
                    {"_id": {"$in": [e.id for e in published]}},
                    {
                        "$set": {
                            "status": "published",
                            "published_at": now,
                            "expire_at": now + self.outbox.retention,
                        },
                        "$unset": {"claim": "", "last_error": ""},
                    },
                )
            )
        for failure in failed:
            event = failure.event
            if failure.park:
                # Parked: kept with its error for an operator, and no longer holding its
                # aggregate back.
                ops.append(
                    UpdateOne(
                        {"_id": event.id, "status": "pending", "claim": self.token},
                        {
                            "$set": {"status": "parked", "last_error": failure.error},
                            "$inc": {"attempts": 1},
                            "$unset": {"claim": ""},
                        },
                    )
                )
                continue
            ops.append(
                # Conditional on our claim: a relay whose lease ran out must not move another's.
                UpdateOne(
                    {"_id": event.id, "status": "pending", "claim": self.token},
                    {
                        "$set": {"available_at": failure.retry_at, "last_error": failure.error},
                        "$inc": {"attempts": int(failure.counted)},
                        "$unset": {"claim": ""},
                    },
                )
            )
            # What queues behind a failed entry waits as long, so it is not claimed in vain
            # and the batch is not filled with entries that cannot go yet.
            ops.append(
                UpdateMany(
                    {
                        "status": "pending",
                        "aggregate_type": event.aggregate_type,
                        "aggregate_id": event.aggregate_id,
                        "sequence": {"$gt": event.sequence},
                        "claim": {"$in": [self.token, None]},
                    },
                    {"$set": {"available_at": failure.retry_at}, "$unset": {"claim": ""}},
                )
            )
        # Anything else still under this claim (a batch cut short) becomes claimable at once.
        ops.append(
            UpdateMany(
                {"claim": self.token, "status": "pending"},
                {"$set": {"available_at": now}, "$unset": {"claim": ""}},
            )
        )
        await self.coll.bulk_write(ops, ordered=True)

    async def parked(self) -> list[dict[str, Any]]:
        return list(await self.coll.find({"status": "parked"}).sort("_id", 1).to_list(None))

    async def requeue(self, event_ids: Sequence[str]) -> int:
        result = await self.coll.update_many(
            {"_id": {"$in": list(event_ids)}, "status": "parked"},
            {"$set": {"status": "pending", "available_at": utc_now(), "attempts": 0}},
        )
        return int(result.modified_count)


class EmbeddedStore:
    """Parked entries stay in their document, flagged ``parked``: parking is one single-document
    write like every other, so no crash can lose an entry or leave it in two places."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.field = outbox.field
        self.due = outbox.due_field
        self.claim_field = outbox.claim_field
        self.token = ""
        self.attempts: dict[str, int] = {}
        self.docs: list[tuple[str, Any]] = []
        self.owners: dict[str, tuple[str, Any]] = {}

    async def claim(
        self, limit: int, lease: timedelta, until: datetime | None = None
    ) -> tuple[list[list[Event]], bool]:
        now = utc_now()
        self.token = uuid.uuid4().hex
        self.docs, self.owners, self.attempts = [], {}, {}
        groups: list[list[Event]] = []
        more = False
        for name in self.outbox.collections:
            coll = self.outbox.db[name]
            due = {self.due: {"$lte": min(now, until or now)}}
            ids = [
                d["_id"]
                for d in await coll.find(due, projection={"_id": 1})
                .sort(self.due, 1)
                .limit(limit)
                .to_list(None)
            ]
            if not ids:
                continue
            claimed = await coll.update_many(
                {"_id": {"$in": ids}, **due},
                {"$set": {self.due: now + lease, self.claim_field: self.token}},
            )
            more = more or len(ids) == limit or claimed.modified_count < len(ids)
            if not claimed.modified_count:
                continue
            docs = await coll.find(
                {self.claim_field: self.token}, projection={self.field: 1}
            ).to_list(None)
            idle = []
            for doc in docs:
                entries = [e for e in doc.get(self.field) or [] if not e.get("parked")]
                if not entries:
                    # Nothing but parked entries (another relay settled it meanwhile): no
                    # settle will come for it, so it must not stay claimed.
                    idle.append(doc["_id"])
                    continue
                events = [decode(entry, "id") for entry in entries]
                self.attempts.update((e["id"], e.get("attempts", 0)) for e in entries)
                self.docs.append((name, doc["_id"]))
                self.owners.update((e.id, (name, doc["_id"])) for e in events)
                groups.append(events)
            if idle:
                await coll.bulk_write([self._release(idle, now), self._unindex(idle)], ordered=True)
        return groups, more

    async def settle(self, published: Sequence[Event], failed: Sequence[Failure]) -> None:
        now = utc_now()
        done: dict[tuple[str, Any], list[str]] = defaultdict(list)
        for event in published:
            done[self.owners[event.id]].append(event.id)
        failures = {self.owners[f.event.id]: f for f in failed}
        ops: dict[str, list[Any]] = defaultdict(list)
        for name, doc_id in self.docs:
            mine = {"_id": doc_id, self.claim_field: self.token}
            ids = done.get((name, doc_id))
            if ids:
                ops[name].append(
                    UpdateOne({"_id": doc_id}, {"$pull": {self.field: {"id": {"$in": ids}}}})
                )
            failure = failures.get((name, doc_id))
            if failure is not None and failure.park:
                # Out of the way at once: its aggregate's later entries go on without it.
                ops[name].append(
                    UpdateOne(
                        {**mine, f"{self.field}.id": failure.event.id},
                        {
                            "$set": {
                                self.due: now,
                                f"{self.field}.$.parked": True,
                                f"{self.field}.$.last_error": failure.error,
                            },
                            "$inc": {f"{self.field}.$.attempts": 1},
                            "$unset": {self.claim_field: ""},
                        },
                    )
                )
            elif failure is not None:
                ops[name].append(
                    UpdateOne(
                        {**mine, f"{self.field}.id": failure.event.id},
                        {
                            "$set": {
                                self.due: failure.retry_at,
                                f"{self.field}.$.last_error": failure.error,
                            },
                            "$inc": {f"{self.field}.$.attempts": int(failure.counted)},
                            "$unset": {self.claim_field: ""},
                        },
                    )
                )
            else:
                ops[name].append(self._release([doc_id], now))
            ops[name].append(self._unindex([doc_id]))
        for name, writes in ops.items():
            await self.outbox.db[name].bulk_write(writes, ordered=True)

    def _release(self, doc_ids: list[Any], now: datetime) -> UpdateMany:
        return UpdateMany(
            {"_id": {"$in": doc_ids}, self.claim_field: self.token},
            {"$set": {self.due: now}, "$unset": {self.claim_field: ""}},
        )

    def _unindex(self, doc_ids: list[Any]) -> UpdateMany:
        # Only an unclaimed document with nothing left but parked entries leaves the relay's
        # index; a claimer's own settle decides for the one it holds.
        return UpdateMany(
            {"_id": {"$in": doc_ids}, self.claim_field: None, **self._nothing_due},
            {"$unset": {self.due: ""}},
        )

    @property
    def _nothing_due(self) -> dict[str, Any]:
        return {self.field: {"$not": {"$elemMatch": {"parked": {"$ne": True}}}}}

    async def parked(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for name in self.outbox.collections:
            docs = self.outbox.db[name].find(
                {f"{self.field}.parked": True}, projection={self.field: 1}
            )
            async for doc in docs:
                found += [
                    {"_id": e["id"], **e, "status": "parked", "collection": name}
                    for e in doc[self.field]
                    if e.get("parked")
                ]
        for entry in found:
            del entry["id"], entry["parked"]
        return sorted(found, key=lambda entry: str(entry["_id"]))

    async def requeue(self, event_ids: Sequence[str]) -> int:
        requeued = 0
        for name in self.outbox.collections:
            for event_id in event_ids:
                result = await self.outbox.db[name].update_one(
                    {self.field: {"$elemMatch": {"id": event_id, "parked": True}}},
                    self._requeue(event_id),
                )
                requeued += result.modified_count
        return requeued

    def _requeue(self, event_id: str) -> list[dict[str, Any]]:
        # One write: the entry is unparked and its document due at once, unless a relay holds
        # the document (then that relay's settle makes it due). Two writes could leave an
        # unparked entry in a document no relay looks at.
        entry = {"$and": [{"$eq": ["$$e.id", event_id]}, {"$eq": ["$$e.parked", True]}]}
        fresh = {"$mergeObjects": ["$$e", {"parked": False, "attempts": 0}]}
        unclaimed = {"$eq": [{"$ifNull": [f"${self.claim_field}", None]}, None]}
        return [
            {
                "$set": {
                    self.field: {
                        "$map": {
                            "input": f"${self.field}",
                            "as": "e",
                            "in": {"$cond": [entry, fresh, "$$e"]},
                        }
                    },
                    self.due: {"$cond": [unclaimed, utc_now(), f"${self.due}"]},
                }
            }
        ]
