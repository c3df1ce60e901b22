"""Parked entries of embedded mode: listed, counted and requeued where they are, in their
aggregate's document (``EmbeddedStore`` parks them there, flagged ``parked``; an entry whose id
another document holds is parked here, at claim time). Each requeue is
one single-document write, so no crash can leave an entry unparked in a document no relay looks
at.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from pymongo import UpdateOne

from mongo_outbox._codec import shown
from mongo_outbox._driver import aggregate
from mongo_outbox._relay.store.base import (
    Activity,
    ParkedKey,
    by,
    chunks,
    counts,
    hashable,
    tolerant,
)
from mongo_outbox._relay.store.published_ids import PublishedIds
from mongo_outbox._storage import (
    ATTEMPTS,
    EXPIRE_AT,
    LAST_ERROR,
    MISSES,
    PARKED,
    PARKED_AT,
    PARKED_BY,
    PARKED_FLAG,
    PENDING,
    PUBLISHED_BY,
    STATUS,
    WAITS,
    Holder,
    Taken,
)
from mongo_outbox.events import Event, utc_now


class Read(NamedTuple):
    """An entry as a claim read it: its event, the entry (numbered), and where it stands in
    its document's array, as stored (to park it, and no other entry of the same id)."""

    event: Event
    entry: dict[str, Any]
    position: int
    raw: Any


class Doomed(NamedTuple):
    """An entry to park: its document, the entry, and who holds its id in the registry."""

    place: Holder
    read: Read
    taken: Taken


class ParkedEntries:
    """The parked-entry operations of ``EmbeddedStore``, over its ``colls`` and fields."""

    field: str
    relay: str | None
    ids: PublishedIds
    due: str
    claim_field: str
    colls: dict[str, Any]

    async def _park_taken(self, doomed: Sequence[Doomed], token: str) -> None:
        """Park where they are the entries whose id another document holds (``_write.event_ids``):
        published, one of the two would be dropped by the broker as the other's duplicate."""
        parks: dict[str, list[UpdateOne]] = defaultdict(list)
        for (name, doc_id), (event, _, position, raw), ((holder, holder_id), sequence) in doomed:
            which = f"event {sequence} of " if sequence is not None else ""
            error = (
                f"DuplicateEventError: event id {event.id} is taken by {which}{holder} "
                f"{holder_id!r}: the broker would drop one of the two as a duplicate"
            )
            # By position, as stored: the document may hold the id twice (a copy of an event
            # saved into it twice), and the other entry is the one that goes out.
            entry = f"{self.field}.{position}"
            parks[name].append(
                UpdateOne(
                    {"_id": doc_id, self.claim_field: token, entry: {"$eq": raw}},
                    # Its number too, as settle's park writes it (_codec.numbered).
                    {
                        "$set": {
                            f"{entry}.{PARKED_FLAG}": True,
                            f"{entry}.{PARKED_AT}": utc_now(),
                            f"{entry}.{PARKED_BY}": self.relay,
                            f"{entry}.{LAST_ERROR}": error,
                            f"{entry}.sequence": event.sequence,
                        }
                    },
                )
            )
        for name, writes in parks.items():
            await tolerant(self.colls[name].bulk_write(writes, ordered=False))

    async def parked(
        self, event_ids: Sequence[Any] | None = None, fields: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        paths = None if fields is None else self._paths(fields)
        if event_ids is None:
            query = {f"{self.field}.{PARKED_FLAG}": True}
            found = [listed async for listed in self._parked(query, paths)]
            return sorted(found, key=lambda entry: str(entry["_id"]))
        chosen: list[dict[str, Any]] = []
        for chunk in chunks(event_ids):
            wanted = {hashable(i) for i in chunk}
            async for listed in self._parked(self._holding(chunk), paths):
                if hashable(listed["_id"]) in wanted:
                    chosen.append(listed)
        return sorted(chosen, key=lambda entry: str(entry["_id"]))

    def _paths(self, fields: Sequence[str]) -> list[str]:
        """The projection of ``fields`` of every entry of a document (of a wrapped one, of its
        original), with what tells a parked entry: its flag and its error."""
        names = ["id" if name == "_id" else name for name in fields if name != "collection"]
        return [
            *(f"{self.field}.{wrap}{name}" for wrap in ("", "entry.") for name in names),
            f"{self.field}.{PARKED_FLAG}",
            f"{self.field}.{LAST_ERROR}",
        ]

    async def parked_keys(self) -> list[ParkedKey]:
        # Of each entry only what a key holds (of a wrapped one, of its original): not the
        # payloads of every entry of every document that holds a parked one.
        paths = self._paths(("_id", "type", "aggregate_id"))
        found = self._parked({f"{self.field}.{PARKED_FLAG}": True}, paths)
        chosen = [ParkedKey.of(listed) async for listed in found]
        return sorted(chosen, key=lambda key: str(key.id))

    async def _parked(
        self, query: dict[str, Any], fields: list[str] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """The parked entries of the documents ``query`` finds (only ``fields`` of them when
        given), one document in memory at a time."""
        projection = dict.fromkeys(fields or [self.field], 1)
        for name, coll in self.colls.items():
            async for doc in coll.find(query, projection=projection):
                for entry in doc.get(self.field) or ():
                    if isinstance(entry, dict) and entry.get(PARKED_FLAG):
                        yield self._listed(entry, name, whole=fields is None)

    def _holding(self, event_ids: list[Any]) -> dict[str, Any]:
        """The documents holding any of ``event_ids`` parked, or parked wrapped (an unreadable
        entry keeps its original under ``entry``)."""
        return {
            "$or": [
                {self.field: {"$elemMatch": {key: {"$in": event_ids}, PARKED_FLAG: True}}}
                for key in ("id", "entry.id")
            ]
        }

    @staticmethod
    def _listed(entry: dict[str, Any], collection: str, whole: bool = True) -> dict[str, Any]:
        # An unreadable entry was parked wrapped, its original under "entry": show its fields.
        # Projected, as read: the defaults of the fields left out would lie.
        original = entry.get("entry", entry)
        if not isinstance(original, dict):
            fields: dict[str, Any] = {"entry": original}
        else:
            fields = original if "entry" in entry or not whole else shown(original)
        rest = {
            k: v
            for k, v in fields.items()
            if k not in ("id", PARKED_FLAG, PARKED_AT, PARKED_BY, LAST_ERROR)
        }
        parked = bool(entry.get(PARKED_FLAG))
        return {
            "_id": fields.get("id"),
            **rest,
            STATUS: PARKED if parked else PENDING,
            PARKED_AT: entry.get(PARKED_AT) if parked else None,
            LAST_ERROR: entry.get(LAST_ERROR),
            "collection": collection,
        }

    async def activity(
        self, expired_after: datetime | None, parked_after: datetime | None
    ) -> Activity:
        # Published entries leave their documents: the registry keeps their ids until they
        # expire, marked with who published them.
        registry = self.ids.registry
        latest = await registry.find_one(
            {EXPIRE_AT: {"$exists": True}}, sort=[(EXPIRE_AT, -1)], projection={EXPIRE_AT: 1}
        )
        mark = latest.get(EXPIRE_AT) if latest else None
        if parked_after is None:
            return Activity(mark)
        since = {"$gt": expired_after} if expired_after is not None else {"$exists": True}
        published = await aggregate(registry, [{"$match": {EXPIRE_AT: since}}, by(PUBLISHED_BY)])
        recent = {"$gt": parked_after}
        parked: list[dict[str, Any]] = []
        for coll in self.colls.values():
            parked += await aggregate(
                coll,
                [
                    {"$match": {f"{self.field}.parked_at": recent}},
                    {"$unwind": f"${self.field}"},
                    {"$match": {f"{self.field}.parked": True, f"{self.field}.parked_at": recent}},
                    by(f"{self.field}.parked_by"),
                ],
            )
        return Activity(mark, counts(published), counts(parked))

    async def entry(self, event_id: Any) -> dict[str, Any] | None:
        # By the entries' ids, parked wrapped or not: the registry may not hold an id saved
        # without a reservation that no relay claimed yet.
        query = {"$or": [{f"{self.field}.{key}": {"$eq": event_id}} for key in ("id", "entry.id")]}
        for name, coll in self.colls.items():
            doc = await coll.find_one(query, projection={self.field: 1})
            for entry in (doc or {}).get(self.field) or ():
                if isinstance(entry, dict) and event_id in (
                    entry.get("id"),
                    _original(entry).get("id"),
                ):
                    return self._listed(entry, name)
        return None

    async def of_aggregates(
        self, aggregate_ids: Sequence[Any], fields: Sequence[str], limit: int
    ) -> list[dict[str, Any]]:
        # An aggregate's document holds its entries not yet published, in its order.
        paths = [*self._paths(fields), *(f"{self.field}.{k}" for k in ("occurred_at", PARKED_AT))]
        projection = dict.fromkeys(paths, 1)
        found: list[dict[str, Any]] = []
        for name, coll in self.colls.items():
            docs = coll.find({"_id": {"$in": list(aggregate_ids)}}, projection=projection)
            async for doc in docs.sort("_id", 1):
                for entry in doc.get(self.field) or ():
                    if isinstance(entry, dict) and len(found) < limit:
                        found.append(self._listed(entry, name, whole=False))
        return found

    async def parked_count(self) -> int:
        parked = {
            "$filter": {"input": f"${self.field}", "cond": {"$eq": [f"$$this.{PARKED_FLAG}", True]}}
        }
        total = 0
        for coll in self.colls.values():
            counts = await aggregate(
                coll,
                [
                    {"$match": {f"{self.field}.{PARKED_FLAG}": True}},
                    {"$group": {"_id": None, "n": {"$sum": {"$size": parked}}}},
                ],
            )
            total += sum(int(d["n"]) for d in counts)
        return total

    async def requeue(self, event_ids: Sequence[str]) -> int:
        requeued = 0
        for chunk in chunks(event_ids):
            requeued += await self._requeue_chunk(chunk)
        return requeued

    async def _requeue_chunk(self, chunk: list[str]) -> int:
        requeued = 0
        wanted = {hashable(i) for i in chunk}
        for coll in self.colls.values():
            docs = coll.find(self._holding(chunk), projection={self.field: 1})
            async for doc in docs:
                # The entries are in their aggregate's order (each write appends its own), so
                # the earlier parked ones are those before the last one asked for.
                parked = [
                    (index, _parked_id(e))
                    for index, e in enumerate(doc[self.field])
                    if isinstance(e, dict) and e.get(PARKED_FLAG)
                ]
                upto = max((index for index, id_ in parked if hashable(id_) in wanted), default=-1)
                ids = [id_ for index, id_ in parked if id_ is not None and index <= upto]
                if not ids:  # an id the query matched inside an array: no entry of ours
                    continue
                result = await coll.update_one({"_id": doc["_id"]}, self._requeue(ids))
                requeued += len(ids) if result.modified_count else 0
        return requeued

    def _requeue(self, event_ids: list[Any]) -> list[dict[str, Any]]:
        # One write: the entries are unparked and their document due at once, unless a relay
        # holds the document (then that relay's settle makes it due). Two writes could leave an
        # unparked entry in a document no relay looks at. Ids go in as literals: an id such as
        # "$x" would otherwise be read as a field path.
        ids = {"$literal": event_ids}
        parked = {"$eq": [f"$$e.{PARKED_FLAG}", True]}
        chosen = {"$and": [parked, {"$in": [{"$ifNull": ["$$e.id", None]}, ids]}]}
        again = {
            PARKED_FLAG: False,
            PARKED_AT: None,
            PARKED_BY: None,
            ATTEMPTS: 0,
            WAITS: 0,
            MISSES: 0,
        }
        fresh = {"$mergeObjects": ["$$e", again]}
        # An unreadable entry was parked wrapped, its original under "entry": it comes back as
        # it was (to be read again: a fix by hand, a newer version), in its place, if it has its
        # number (_park_at).
        wrapped = {
            "$and": [
                parked,
                {"$eq": [{"$type": "$$e.entry"}, "object"]},
                {"$in": [{"$type": "$$e.entry.sequence"}, ["int", "long"]]},
                {"$in": [{"$ifNull": ["$$e.entry.id", None]}, ids]},
            ]
        }
        unwrapped = {"$mergeObjects": ["$$e.entry", again]}
        unclaimed = {"$eq": [{"$ifNull": [f"${self.claim_field}", None]}, None]}
        return [
            {
                "$set": {
                    self.field: {
                        "$map": {
                            "input": f"${self.field}",
                            "as": "e",
                            "in": {
                                "$cond": [chosen, fresh, {"$cond": [wrapped, unwrapped, "$$e"]}]
                            },
                        }
                    },
                    self.due: {"$cond": [unclaimed, {"$literal": utc_now()}, f"${self.due}"]},
                }
            }
        ]


def _original(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry a wrapped (unreadable) parked one keeps under ``entry``, else itself."""
    original = entry.get("entry", entry)
    return original if isinstance(original, dict) else {}


def _parked_id(entry: dict[str, Any]) -> Any:
    """The event id of a parked entry a requeue can bring back (None: none). A wrapped one
    without its number cannot come back: its position may no longer tell it; fix it by hand."""
    if "id" in entry:
        return entry["id"]
    original = entry.get("entry")
    if not isinstance(original, dict) or type(original.get("sequence")) is not int:
        return None
    return original.get("id")
