"""A change-stream relay's checkpoint document: its resume token and the lease that makes one
process per relay name the active one.

One document per relay name, ``{_id: name, token, checkpoint_at, owner, fence, lease_until}``.
Taking the lease over increments ``fence``; every later write of the holder is conditional on
``{_id, fence}``, so a relay that was paused past its lease (GC, network partition) and wakes up
can no longer move the checkpoint: its write matches nothing and it steps down.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from mongo_outbox.events import utc_now


class LeaseLost(Exception):
    """Another process took this relay name over; this one must stop writing and stand by."""


class Checkpoint:
    """The checkpoint and lease of relay ``name`` in collection ``coll``.

    Parameters:
        coll: the checkpoint collection.
        name: the relay name (the document's ``_id``).
        lease: how long a holder keeps the lease without renewing it; it renews every third.
    """

    def __init__(self, coll: Any, name: str, lease: timedelta) -> None:
        self.coll = coll
        self.name = name
        self.lease = lease
        self.owner = uuid.uuid4().hex
        self.fence: int | None = None
        self._renew_at = utc_now()

    @property
    def held(self) -> bool:
        return self.fence is not None

    async def acquire(self) -> bool:
        """Renew the lease if it is ours, or take it once the holder's ran out. Returns whether
        this process holds it now. Cheap when called often: it writes only every lease/3."""
        now = utc_now()
        if self.fence is not None and now < self._renew_at:
            return True
        if self.fence is not None:
            renewed = await self.coll.update_one(
                {"_id": self.name, "owner": self.owner, "fence": self.fence},
                {"$set": {"lease_until": now + self.lease}},
            )
            if renewed.matched_count:
                self._renew_at = now + self.lease / 3
                return True
            self.fence = None
        try:
            doc = await self.coll.find_one_and_update(
                {"_id": self.name, "lease_until": {"$not": {"$gt": now}}},
                {
                    "$set": {"owner": self.owner, "lease_until": now + self.lease},
                    "$inc": {"fence": 1},
                },
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
        except DuplicateKeyError:
            # The document exists with a live lease, so the upsert collided: another holds it.
            return False
        self.fence = int(doc["fence"])
        self._renew_at = now + self.lease / 3
        return True

    async def keep(self) -> None:
        """Renew the lease if due; raise LeaseLost if it is no longer ours."""
        if not await self.acquire():
            raise LeaseLost(f"relay {self.name}: another process took the lease over")

    async def save(self, token: Any) -> None:
        """Store the resume token and renew the lease, in one write fenced on our token."""
        now = utc_now()
        result = await self.coll.update_one(
            {"_id": self.name, "fence": self.fence},
            {"$set": {"token": token, "checkpoint_at": now, "lease_until": now + self.lease}},
        )
        if not result.matched_count:
            self.fence = None
            raise LeaseLost(f"relay {self.name}: another process took the lease over")
        self._renew_at = now + self.lease / 3

    async def release(self) -> None:
        """Give the lease up at once, so a standby need not wait for it to run out."""
        if self.fence is not None:
            await self.coll.update_one(
                {"_id": self.name, "owner": self.owner, "fence": self.fence},
                {"$set": {"lease_until": utc_now()}},
            )
            self.fence = None

    async def load(self) -> dict[str, Any]:
        return dict(await self.coll.find_one({"_id": self.name}) or {})
