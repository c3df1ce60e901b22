"""The relay's side of the event-id registry of embedded mode (``_write.event_ids`` says what
the registry is for and why its writes lose nothing): before it publishes, a relay takes each id
of a claimed document for that entry; once the broker confirmed them, its settle marks them
published, to expire ``retention`` later."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from pymongo import UpdateOne
from pymongo.errors import BulkWriteError

from mongo_outbox._commands import chunked
from mongo_outbox._driver import DUPLICATE_KEY
from mongo_outbox._storage import (
    EXPIRE_AT,
    HOLDER_COLLECTION,
    HOLDER_DOCUMENT,
    HOLDER_SEQUENCE,
    MARKED_PUBLISHED,
    PUBLISHED_BY,
    Taken,
)
from mongo_outbox._write.refusals import write_errors


class PublishedIds:
    """The relay's side of the registry: ids whose events the broker confirmed."""

    def __init__(self, registry: Any, retention: timedelta) -> None:
        self.registry = registry
        self.retention = retention

    async def own(self, held: Mapping[str, Taken]) -> dict[str, Taken]:
        """Take each id of ``held`` (event id: its collection's name and document ``_id``, and
        its sequence) for that entry, unless it is that entry's already; return the ids held
        otherwise, each with the registry's holder and sequence: another document's, or this
        document's under another sequence (an event published before, its id given again)."""
        if not held:
            return {}
        # Most ids are new to the registry (the library made them and saves do not reserve
        # them): one insert of the whole claim. Only the ids already there need a condition.
        ids = list(held)
        entries = [
            {
                "_id": i,
                HOLDER_COLLECTION: collection,
                HOLDER_DOCUMENT: doc_id,
                HOLDER_SEQUENCE: sequence,
            }
            for i, ((collection, doc_id), sequence) in held.items()
        ]
        try:
            await self.registry.insert_many(entries, ordered=False)
            return {}
        except BulkWriteError as error:
            there = {ids[e["index"]]: e.get("code") for e in write_errors(error)}
            if not there or any(code != DUPLICATE_KEY for code in there.values()):
                raise  # not (only) ids already there: a write concern error, say
        return await self._take({i: held[i] for i in there})

    async def _take(self, held: Mapping[str, Taken]) -> dict[str, Taken]:
        ids = list(held)
        ops = []
        for i in ids:
            (collection, doc_id), sequence = held[i]
            # A save's reservation has no sequence yet; a crashed relay's own has this one.
            mine = {
                "_id": i,
                HOLDER_COLLECTION: collection,
                HOLDER_DOCUMENT: doc_id,
                HOLDER_SEQUENCE: {"$in": [sequence, None]},
            }
            ops.append(UpdateOne(mine, {"$set": {HOLDER_SEQUENCE: sequence}}, upsert=True))
        try:
            await self.registry.bulk_write(ops, ordered=False)
            return {}
        except BulkWriteError as error:
            failed = {ids[e["index"]]: e.get("code") for e in write_errors(error)}
            if any(code != DUPLICATE_KEY for code in failed.values()):
                raise
        # The filter missed and the insert collided: the id is held otherwise.
        found = []
        for chunk in chunked(list(failed)):
            found += await self.registry.find({"_id": {"$in": chunk}}).to_list(None)
        return {
            d["_id"]: ((d.get(HOLDER_COLLECTION), d.get(HOLDER_DOCUMENT)), d.get(HOLDER_SEQUENCE))
            for d in found
        }

    async def mark_published(
        self, published: Sequence[tuple[str, str, Any]], now: datetime, by: str | None = None
    ) -> None:
        """Mark each ``(event id, collection, document _id)`` published, to expire ``retention``
        from ``now``. An id with no reservation (one pruned under an older version's rule, or
        removed by hand) gets one, so it stays taken all the same."""
        if not published:
            return
        expire_at = now + self.retention
        # Who published them (``by``, a relay's name), for the console's rates.
        marked = {"$set": {MARKED_PUBLISHED: True, EXPIRE_AT: expire_at, PUBLISHED_BY: by}}
        ids = list(dict.fromkeys(event_id for event_id, _, _ in published))
        # One statement for the common case (a claim's worth of ids, in bounded commands):
        # every id has its reservation.
        matched = 0
        for chunk in chunked(ids):
            matched += (
                await self.registry.update_many({"_id": {"$in": chunk}}, marked)
            ).matched_count
        if matched >= len(ids):
            return
        await self.registry.bulk_write(
            [
                UpdateOne(
                    {"_id": event_id},
                    {
                        "$set": {MARKED_PUBLISHED: True, EXPIRE_AT: expire_at, PUBLISHED_BY: by},
                        "$setOnInsert": {HOLDER_COLLECTION: collection, HOLDER_DOCUMENT: doc_id},
                    },
                    upsert=True,
                )
                for event_id, collection, doc_id in published
            ],
            ordered=False,
        )
