"""What a test needs to see or do below the relay's store, in both outbox modes: which claim
holds an entry, which entries of an aggregate are parked, and time passing (due times moved to
now instead of sleeping out a backoff or a lease). The relays never read through this: it is the
test's view of the same documents."""

from __future__ import annotations

from typing import Any

from mongo_outbox import Event, Outbox
from mongo_outbox.events import utc_now


class Storage:
    def __init__(self, outbox: Outbox) -> None:
        self.mode = outbox.mode
        self.entries = outbox.collection
        self.docs = outbox.db[outbox.collections[0]] if outbox.collections else None
        self.field = outbox.field
        self.due = outbox.due_field
        self.claim = outbox.claim_field

    async def claims(self) -> set[str]:
        """The claim tokens held anywhere in the outbox."""
        if self.mode == "collection":
            found = self.entries.find({"claim": {"$ne": None}}, projection={"claim": 1})
            return {entry["claim"] for entry in await found.to_list(None)}
        assert self.docs is not None
        found = self.docs.find({self.claim: {"$ne": None}}, projection={self.claim: 1})
        return {doc[self.claim] for doc in await found.to_list(None)}

    def key(self, event: Event) -> Any:
        """What a claim holds of an event: its entry (collection mode) or its aggregate's
        document (embedded mode), as ``held`` names them."""
        return event.id if self.mode == "collection" else event.aggregate_id

    async def held(self, token: str) -> set[Any]:
        """The ``_id`` of every entry (document, in embedded mode) this claim holds."""
        found = self.entries if self.mode == "collection" else self.docs
        assert found is not None
        claim = "claim" if self.mode == "collection" else self.claim
        return {
            d["_id"] for d in await found.find({claim: token}, projection={"_id": 1}).to_list(None)
        }

    async def parked(self, aggregate_id: Any) -> set[str]:
        """Ids of the parked entries of one aggregate."""
        if self.mode == "collection":
            found = self.entries.find(
                {"aggregate_id": aggregate_id, "status": "parked"}, projection={"_id": 1}
            )
            return {entry["_id"] for entry in await found.to_list(None)}
        assert self.docs is not None
        doc = await self.docs.find_one({"_id": aggregate_id}, projection={self.field: 1})
        return {e["id"] for e in (doc or {}).get(self.field) or [] if e.get("parked")}

    async def make_due(self, token: str | None = None) -> int:
        """Time passes: with no ``token``, every backoff and recheck delay of the entries no claim
        holds runs out; with one, that claim's lease runs out (and nothing else). Returns how
        many entries (documents, in embedded mode) became due."""
        now = utc_now()
        if self.mode == "collection":
            result = await self.entries.update_many(
                {"status": "pending", "claim": token}, {"$set": {"available_at": now}}
            )
        else:
            assert self.docs is not None
            result = await self.docs.update_many(
                {self.due: {"$exists": True}, self.claim: token}, {"$set": {self.due: now}}
            )
        return int(result.modified_count)

    async def make_all_due(self) -> None:
        """Time passes beyond every backoff and every lease."""
        for token in await self.claims():
            await self.make_due(token)
        await self.make_due(None)
