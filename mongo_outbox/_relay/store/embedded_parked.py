"""Parked entries of embedded mode: listed, counted and requeued where they are, in their
aggregate's document (``EmbeddedStore`` parks them there, flagged ``parked``; an entry whose id
another document holds is parked here, at claim time). Each requeue is
one single-document write, so no crash can leave an entry unparked in a document no relay looks
at.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from pymongo import UpdateOne

from mongo_outbox._codec import shown
from mongo_outbox._driver import aggregate
from mongo_outbox._relay.store.base import batches
from mongo_outbox._write.event_ids import Holder, Taken
from mongo_outbox.events import Event, utc_now

Doomed = tuple[Holder, Event, Taken]
"""An entry to park: its document, its event, and who holds its id in the registry."""


class ParkedEntries:
    """The parked-entry operations of ``EmbeddedStore``, over its ``colls`` and fields."""

    field: str
    due: str
    claim_field: str
    colls: dict[str, Any]

    async def _park_taken(self, doomed: Sequence[Doomed], token: str) -> None:
        """Park where they are the entries whose id another document holds (``_write.event_ids``):
        published, one of the two would be dropped by the broker as the other's duplicate."""
        parks: dict[str, list[UpdateOne]] = defaultdict(list)
        for (name, doc_id), event, ((holder, holder_id), sequence) in doomed:
            which = f"event {sequence} of " if sequence is not None else ""
            error = (
                f"DuplicateEventError: event id {event.id} is taken by {which}{holder} "
                f"{holder_id!r}: the broker would drop one of the two as a duplicate"
            )
            entry = f"{self.field}.$"
            parks[name].append(
                UpdateOne(
                    {"_id": doc_id, self.claim_field: token, f"{self.field}.id": event.id},
                    # Its number too, as settle's park writes it (_codec.numbered).
                    {
                        "$set": {
                            f"{entry}.parked": True,
                            f"{entry}.last_error": error,
                            f"{entry}.sequence": event.sequence,
                        }
                    },
                )
            )
        for name, writes in parks.items():
            await self.colls[name].bulk_write(writes, ordered=False)

    async def parked(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for name, coll in self.colls.items():
            docs = coll.find({f"{self.field}.parked": True}, projection={self.field: 1})
            async for doc in docs:
                for entry in doc[self.field]:
                    if isinstance(entry, dict) and entry.get("parked"):
                        found.append(self._listed(entry, name))
        return sorted(found, key=lambda entry: str(entry["_id"]))

    @staticmethod
    def _listed(entry: dict[str, Any], collection: str) -> dict[str, Any]:
        # An unreadable entry was parked wrapped, its original under "entry": show its fields.
        original = entry.get("entry", entry)
        if not isinstance(original, dict):
            fields: dict[str, Any] = {"entry": original}
        else:
            fields = original if "entry" in entry else shown(original)
        rest = {k: v for k, v in fields.items() if k not in ("id", "parked", "last_error")}
        return {
            "_id": fields.get("id"),
            **rest,
            "status": "parked",
            "last_error": entry.get("last_error"),
            "collection": collection,
        }

    async def parked_count(self) -> int:
        parked = {"$filter": {"input": f"${self.field}", "cond": {"$eq": ["$$this.parked", True]}}}
        total = 0
        for coll in self.colls.values():
            counts = await aggregate(
                coll,
                [
                    {"$match": {f"{self.field}.parked": True}},
                    {"$group": {"_id": None, "n": {"$sum": {"$size": parked}}}},
                ],
            )
            total += sum(int(d["n"]) for d in counts)
        return total

    async def requeue(self, event_ids: Sequence[str]) -> int:
        requeued = 0
        for batch in batches(event_ids):
            requeued += await self._requeue_batch(batch)
        return requeued

    async def _requeue_batch(self, batch: list[str]) -> int:
        requeued = 0
        wanted = set(batch)
        # A parked entry, or an unreadable one parked wrapped with its original under "entry".
        asked = {
            "$or": [
                {self.field: {"$elemMatch": {key: {"$in": batch}, "parked": True}}}
                for key in ("id", "entry.id")
            ]
        }
        for coll in self.colls.values():
            docs = coll.find(asked, projection={self.field: 1})
            async for doc in docs:
                # The entries are in their aggregate's order (each write appends its own), so
                # the earlier parked ones are those before the last one asked for.
                parked = [
                    (index, _parked_id(e))
                    for index, e in enumerate(doc[self.field])
                    if isinstance(e, dict) and e.get("parked")
                ]
                upto = max((index for index, id_ in parked if id_ in wanted), default=-1)
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
        parked = {"$eq": ["$$e.parked", True]}
        chosen = {"$and": [parked, {"$in": [{"$ifNull": ["$$e.id", None]}, ids]}]}
        again = {"parked": False, "attempts": 0, "waits": 0}
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


def _parked_id(entry: dict[str, Any]) -> Any:
    """The event id of a parked entry a requeue can bring back (None: none). A wrapped one
    without its number cannot come back: its position may no longer tell it; fix it by hand."""
    if "id" in entry:
        return entry["id"]
    original = entry.get("entry")
    if not isinstance(original, dict) or type(original.get("sequence")) is not int:
        return None
    return original.get("id")
