"""The relay's store for embedded mode: events live in an array inside their aggregate's
document, so every write here is a single-document write, atomic without a transaction.

A document with something to send carries a due time (``<field>_due``, indexed sparse); a
relay claims the document by setting ``<field>_claim``, publishes its entries, marks their ids
published in the event-id registry (``_write.event_ids``: they stay taken for ``retention``), then
pulls the published entries from the array. Parked entries stay in their document, flagged
``parked``: parking is one single-document write like every other, so no crash can lose an
entry or leave it in two places. Round trips per round: find + updateMany + find per collection
and one insertMany of the registry (the ids taken for their documents; a bulkWrite more for ids
already there) to claim, one updateMany of the registry and one bulkWrite per collection to
settle.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import bson
from pymongo import UpdateMany, UpdateOne

from mongo_outbox._codec import counter, decode, numbered, ours, read_for_relay
from mongo_outbox._commands import chunked
from mongo_outbox._partitions import partition_of
from mongo_outbox._relay.store.base import (
    Backlog,
    Claim,
    PublishFailure,
    hashable,
    scope,
    tolerant,
)
from mongo_outbox._relay.store.embedded_parked import Doomed, ParkedEntries, Read
from mongo_outbox._relay.store.published_ids import PublishedIds
from mongo_outbox._storage import (
    ATTEMPTS,
    LAST_ERROR,
    MISSES,
    PARKED_AT,
    PARKED_BY,
    PARKED_FLAG,
    WAITS,
    Holder,
)
from mongo_outbox._write.aggregates import type_of
from mongo_outbox.errors import InvalidEventError, UsageError, describe
from mongo_outbox.events import Event, as_utc, utc_now
from mongo_outbox.outbox import Outbox

_WRITES = frozenset({"insert", "update", "replace"})


class EmbeddedStore(ParkedEntries):
    def __init__(
        self, outbox: Outbox, partition: int | None = None, relay: str | None = None
    ) -> None:
        self.relay = relay
        self.scope = scope(outbox, partition)
        self.partitions = outbox.partitions
        self.partition_field = outbox.partition_field
        self.aggregate_types = outbox.aggregate_types
        self.field = outbox.field
        self.due = outbox.due_field
        self.claim_field = outbox.claim_field
        self.wait_field = outbox.wait_field
        self.sent_field = outbox.sent_field
        self.colls = {name: ours(outbox.db[name]) for name in outbox.collections}
        self.entries = {name: read_for_relay(outbox.db[name]) for name in outbox.collections}
        self.ids = PublishedIds(outbox.event_ids, outbox.retention)
        self._turn = 0

    # -- claiming ---------------------------------------------------------------------------

    async def claim(self, limit: int, lease: timedelta, until: datetime | None = None) -> Claim:
        """Up to ``limit`` documents in all, the collections taking turns to go first so that
        none starves the others."""
        now = utc_now()
        due = {**self.scope, self.due: {"$lte": min(now, until or now)}}
        found: dict[str, list[Any]] = {}
        names = list(self.colls)
        self._turn = (self._turn + 1) % len(names)
        for name in names[self._turn :] + names[: self._turn]:
            left = limit - sum(map(len, found.values()))
            if left <= 0:
                break
            docs = self.colls[name].find(due, projection={"_id": 1}).sort(self.due, 1)
            found[name] = [d["_id"] for d in await docs.limit(left).to_list(None)]
        claim = await self._claim(found, due, now, lease)
        return replace(claim, more=claim.more or sum(map(len, found.values())) >= limit)

    async def claim_changes(self, changes: Sequence[Mapping[str, Any]], lease: timedelta) -> Claim:
        found: dict[str, list[Any]] = defaultdict(list)
        for change in changes:
            if self.may_have_work(change):
                found[change["ns"]["coll"]].append(change["documentKey"]["_id"])
        if not found:
            return Claim(uuid.uuid4().hex)
        now = utc_now()
        return await self._claim(found, {**self.scope, self.due: {"$lte": now}}, now, lease)

    def may_have_work(self, change: Mapping[str, Any]) -> bool:
        """Whether a write to one of our aggregates may have left entries for the relay. A claimed
        document is left to its claimer: its settle writes again (and rings) if entries
        remain, and a dead claimer's lease is found by the scheduled sweep."""
        kind = change.get("operationType")
        name = (change.get("ns") or {}).get("coll")
        if kind not in _WRITES or "documentKey" not in change or name not in self.colls:
            return False
        document = change.get("fullDocument")
        if document is not None:
            entries = document.get(self.field) or []
            return document.get(self.claim_field) is None and any(
                isinstance(e, dict) and not e.get(PARKED_FLAG) for e in entries
            )
        if kind == "update":
            updated = (change.get("updateDescription") or {}).get("updatedFields") or {}
            return any(key == self.field or key.startswith(f"{self.field}.") for key in updated)
        return True

    async def _claim(
        self, found: Mapping[str, list[Any]], due: dict[str, Any], now: datetime, lease: timedelta
    ) -> Claim:
        token = uuid.uuid4().hex
        held: list[tuple[str, Any]] = []
        read: list[tuple[Holder, list[Read]]] = []
        missed = False
        for name, ids in found.items():
            if not ids:
                continue
            coll = self.colls[name]
            claimed = 0
            for chunk in chunked(ids):
                result = await coll.update_many(
                    {"_id": {"$in": chunk}, **due},
                    {"$set": {self.due: now + lease, self.claim_field: token}},
                )
                claimed += result.modified_count
            missed = missed or claimed < len({hashable(i) for i in ids})
            if not claimed:
                continue
            docs = (
                await self.entries[name]
                .find({self.claim_field: token}, projection={self.field: 1, "_sequence": 1})
                .to_list(None)
            )
            unreadable: list[UpdateOne] = []
            for doc in docs:
                held.append((name, doc["_id"]))
                entries: list[Read] = []
                stored = doc.get(self.field) or []
                for index, (raw, entry) in enumerate(
                    zip(stored, numbered(stored, doc.get("_sequence")), strict=True)
                ):
                    if isinstance(entry, dict) and entry.get(PARKED_FLAG):
                        continue
                    try:
                        if not isinstance(entry, dict):
                            raise InvalidEventError(f"outbox entry {entry!r} is not a document")
                        entries.append(Read(decode(entry, "id"), entry, index, raw))
                    except InvalidEventError as error:
                        unreadable.append(
                            self._park_at(doc["_id"], index, raw, entry, token, error)
                        )
                read.append(((name, doc["_id"]), entries))
            if unreadable:
                missed = True  # what queued behind them may go at once
                await tolerant(coll.bulk_write(unreadable, ordered=False))
        owners = await self._owners(read, token)
        missed = missed or sum(len(entries) for _, entries in read) > len(owners)
        groups: list[tuple[Event, ...]] = []
        counters: dict[str, dict[str, int]] = {ATTEMPTS: {}, WAITS: {}, MISSES: {}}
        positions: dict[str, int] = {}
        for place, entries in read:
            group: list[Event] = []
            for event, entry, position, _ in entries:
                # Else parked, or another entry's id: of this document too (a copy of an event
                # saved twice into it), so the entry is told by its sequence, not only its id.
                if owners.get(event.id) == (place, event.sequence):
                    group.append(event)
                    positions[event.id] = position
                    for name, values in counters.items():
                        # A counter another writer stored as no whole number counts as none.
                        values[event.id] = counter(entry.get(name)) or 0
            if group:
                groups.append(tuple(group))
        return Claim(
            token,
            tuple(groups),
            attempts=counters[ATTEMPTS],
            waits=counters[WAITS],
            misses=counters[MISSES],
            holders={event_id: place for event_id, (place, _) in owners.items()},
            positions=positions,
            held=tuple(held),
            more=missed,
        )

    async def _owners(
        self, read: Sequence[tuple[Holder, list[Read]]], token: str
    ) -> dict[str, tuple[Holder, Any]]:
        """Which document each id read goes out from: its own, the id taken for that entry in the
        registry (``_write.event_ids``), unless the registry has it for another entry (of another
        document, or of this one under another sequence) or an earlier document of this claim
        has it. The entries that lose are parked where they are: published, one of two entries
        under one id would be dropped by the broker as the other's duplicate."""
        places: dict[str, list[tuple[Holder, Read]]] = defaultdict(list)
        for place, entries in read:
            for one in entries:
                places[one.event.id].append((place, one))
        first = {i: (found[0][0], found[0][1].event.sequence) for i, found in places.items()}
        taken = await self.ids.own(first)
        owners: dict[str, tuple[Holder, Any]] = {}
        doomed: list[Doomed] = []
        for event_id, found in places.items():
            holder, sequence = taken.get(event_id, first[event_id])
            for place, one in found:
                if (
                    place == holder
                    and sequence in (None, one.event.sequence)
                    and event_id not in owners
                ):
                    owners[event_id] = (place, one.event.sequence)
                else:
                    doomed.append(Doomed(place, one, (holder, sequence)))
        if doomed:
            await self._park_taken(doomed, token)
        return owners

    def _park_at(
        self, doc_id: Any, index: int, raw: Any, entry: Any, token: str, error: Exception
    ) -> UpdateOne:
        """Park an unreadable entry where it is, by position (it may have no id), replacing it
        with a parked record that keeps the original ``entry`` with its number, if it has one:
        entries after it may be published and removed, and then its position no longer tells it
        (``_codec.numbered``). The filter names the exact element as stored (``raw``), so a
        concurrent change of the array can never make it park another."""
        at = f"{self.field}.{index}"
        parked = {
            PARKED_FLAG: True,
            PARKED_AT: utc_now(),
            PARKED_BY: self.relay,
            LAST_ERROR: describe(error),
            "entry": entry,
        }
        # As literals, in a pipeline: an element such as {"$x": 1} is matched and kept as
        # itself, never read as an operator (nor refused by $set as a field name).
        stored = f"${self.field}"
        before = [{"$slice": [stored, 0, index]}] if index else []
        after = {"$slice": [stored, index + 1, _INT32_MAX]}
        return UpdateOne(
            {"_id": doc_id, self.claim_field: token, at: {"$eq": raw}},
            [{"$set": {self.field: {"$concatArrays": [*before, [{"$literal": parked}], after]}}}],
        )

    # -- settling ---------------------------------------------------------------------------

    async def settle(
        self, claim: Claim, published: Sequence[Event], failed: Sequence[PublishFailure]
    ) -> None:
        now = utc_now()
        # Documents are told apart by their hashable form: another producer's _id may be a
        # document, and must not stop the settle of everyone else's.
        done: dict[tuple[str, Hashable], list[str]] = defaultdict(list)
        for event in published:
            done[_key(claim.holders[event.id])].append(event.id)
        # The ids stay taken for retention from now, in the registry, before their entries go:
        # a crash in between leaves them pending here, and they are published again.
        await self.ids.mark_published(
            [(event.id, *claim.holders[event.id]) for event in published], now, self.relay
        )
        failures = {_key(claim.holders[f.event.id]): f for f in failed}
        ops: dict[str, list[Any]] = defaultdict(list)
        for name, doc_id in claim.held:
            mine = {"_id": doc_id, self.claim_field: claim.token}
            ids = done.get(_key((name, doc_id)), [])
            gone = sorted(claim.positions[i] for i in ids)
            if ids:
                # Under our claim only: once another relay holds the document, its round
                # decides what is left (it publishes these again: at least once, never lost).
                # Their ids stay in the document until its next settle: a save repeated at this
                # instant, which found their reservations not yet published, is refused here.
                # The entries claimed go, by position, and no other: a copy of one of them
                # appended or requeued meanwhile stays, for the next claim to park.
                here = {f"{self.field}.{claim.positions[i]}.id": i for i in ids}
                ops[name].append(
                    UpdateOne(
                        mine | here,
                        [
                            {
                                "$set": {
                                    self.field: _without(self.field, gone),
                                    self.sent_field: {"$literal": ids},
                                }
                            }
                        ],
                    )
                )
            failure = failures.get(_key((name, doc_id)))
            if failure is None:
                ops[name].append(self._release([doc_id], claim.token, now))
            else:
                # Where it stands once the published entries before it are gone.
                position = claim.positions[failure.event.id]
                position -= sum(1 for p in gone if p < position)
                entry = f"{self.field}.{position}"
                # Its number is written too: an entry appended unnumbered keeps it however the
                # entries after it come and go (_codec.numbered).
                sets: dict[str, Any] = {
                    f"{entry}.{LAST_ERROR}": failure.error,
                    f"{entry}.sequence": failure.event.sequence,
                }
                if failure.kind == "park":
                    # Out of the way at once: its aggregate's later entries go on without it.
                    sets |= {
                        self.due: now,
                        f"{entry}.{PARKED_FLAG}": True,
                        f"{entry}.{PARKED_AT}": now,
                        f"{entry}.{PARKED_BY}": self.relay,
                    }
                    counter = f"{entry}.{ATTEMPTS}"
                else:
                    sets |= {self.due: failure.retry_at, self.wait_field: failure.wake}
                    kind = {"retry": ATTEMPTS, "wait": WAITS if failure.wake else MISSES}
                    counter = f"{entry}.{kind[failure.kind]}"
                ops[name].append(
                    UpdateOne(
                        {**mine, f"{entry}.id": failure.event.id},
                        {"$set": sets, "$inc": {counter: 1}, "$unset": {self.claim_field: ""}},
                    )
                )
            ops[name].append(self._unindex([doc_id]))
        for name, writes in ops.items():
            await self.colls[name].bulk_write(writes, ordered=True)

    def _release(self, doc_ids: list[Any], token: str, now: datetime) -> UpdateMany:
        return UpdateMany(
            {"_id": {"$in": doc_ids}, self.claim_field: token},
            {"$set": {self.due: now}, "$unset": {self.claim_field: "", self.wait_field: ""}},
        )

    def _unindex(self, doc_ids: list[Any]) -> UpdateMany:
        # Only an unclaimed document with nothing left but parked entries leaves the relay's
        # index; a claimer's own settle decides for the one it holds.
        return UpdateMany(
            {"_id": {"$in": doc_ids}, self.claim_field: None, **self._nothing_due},
            {"$unset": {self.due: "", self.wait_field: ""}},
        )

    @property
    def _nothing_due(self) -> dict[str, Any]:
        return {self.field: {"$not": {"$elemMatch": {PARKED_FLAG: {"$ne": True}}}}}

    async def wake(self, limit: int | None = None) -> int:
        waiting: dict[str, Any] = {**self.scope, self.wait_field: True, self.claim_field: None}
        woken = 0
        for coll in self.colls.values():
            selector: dict[str, Any] = dict(waiting)
            if limit is not None:
                if woken >= limit:
                    break
                docs = coll.find(waiting, projection={"_id": 1}).sort(self.due, 1)
                ids = [d["_id"] for d in await docs.limit(limit - woken).to_list(None)]
                selector["_id"] = {"$in": ids}
            result = await coll.update_many(
                selector, {"$set": {self.due: utc_now(), self.wait_field: False}}
            )
            woken += result.modified_count
        return woken

    # -- reading ----------------------------------------------------------------------------

    def published(self, *args: Any, **kwargs: Any) -> AsyncIterator[Event]:
        raise UsageError(
            "replay needs collection mode: embedded mode removes each entry from its document "
            "once the broker confirmed it (only its id stays reserved), so nothing is left to send"
        )

    async def backlog(self) -> Backlog:
        total, oldest = 0, None
        for coll in self.colls.values():
            docs = coll.find(
                {**self.scope, self.due: {"$exists": True}}, projection={self.field: 1}
            )
            async for doc in docs:
                for entry in doc.get(self.field) or []:
                    if not isinstance(entry, dict) or entry.get(PARKED_FLAG):
                        continue
                    total += 1
                    at = entry.get("occurred_at")
                    if isinstance(at, datetime) and (oldest is None or as_utc(at) < oldest):
                        oldest = as_utc(at)
        return Backlog(total, oldest)

    async def assign_partitions(self, limit: int) -> int:
        if self.partitions == 1:
            return 0
        # A document with something to send has a due time (sparse index); None also matches
        # a missing partition. The document carries its entries' partition, so one write each.
        unassigned = {self.partition_field: None, self.due: {"$exists": True}}
        assigned = 0
        for name, coll in self.colls.items():
            if assigned >= limit:
                break
            docs = coll.find(unassigned, projection={"_id": 1}).limit(limit - assigned)
            kind = type_of(self.aggregate_types, name)
            ids: dict[int, list[Any]] = defaultdict(list)
            for doc in await docs.to_list(None):
                try:
                    k = partition_of(kind, doc["_id"], self.partitions)
                except (ValueError, bson.errors.BSONError):
                    continue  # an _id BSON cannot encode without codec options, nor the writer
                ids[k].append(doc["_id"])
            if not ids:
                continue
            result = await coll.bulk_write(
                [
                    UpdateMany(
                        {"_id": {"$in": group}, **unassigned}, {"$set": {self.partition_field: k}}
                    )
                    for k, group in ids.items()
                ],
                ordered=False,
            )
            assigned += result.modified_count
        return assigned

    async def next_due(self) -> datetime | None:
        times = []
        for coll in self.colls.values():
            doc = await coll.find_one(
                {**self.scope, self.due: {"$exists": True}},
                sort=[(self.due, 1)],
                projection={self.due: 1},
            )
            if doc and isinstance(doc.get(self.due), datetime):
                times.append(as_utc(doc[self.due]))
        return min(times, default=None)


def _key(holder: Holder) -> tuple[str, Hashable]:
    name, doc_id = holder
    return name, hashable(doc_id)


def _without(field: str, positions: list[int]) -> dict[str, Any]:
    """The array ``field`` without the elements at ``positions`` (ascending): the slices
    between them, joined, the last one with whatever was appended since."""
    parts: list[dict[str, Any]] = []
    start = 0
    for position in positions:
        if position > start:
            parts.append({"$slice": [f"${field}", start, position - start]})
        start = position + 1
    parts.append({"$slice": [f"${field}", start, _INT32_MAX]})
    return {"$concatArrays": parts}


_INT32_MAX = 2**31 - 1
"""The most elements a ``$slice`` takes: the rest of any array a document can hold."""
