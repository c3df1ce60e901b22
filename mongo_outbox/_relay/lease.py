"""A fenced lease on a name: the one process that may publish for it (a change-stream relay, or
a relay group's partition), with optional data written under the fence (a change-stream relay's
resume token).

One document per name, ``{_id: name, owner, fence, lease_until}``, plus ``token`` and
``checkpoint_at`` once a change-stream relay saved its checkpoint. Taking the lease over sets a
new ``fence``; every later write of the holder is conditional on ``{_id, owner, fence}``, so a
holder that was paused past its lease (GC, network partition) and wakes up can no longer move
the checkpoint: its write matches nothing and it steps down.

Fences never repeat, even when the document is deleted or recreated: a takeover sets the fence
to the larger of the old fence plus one and the current time in milliseconds, so a recreated
document does not start again at 1 where a deposed leader's fence could match it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError, PyMongoError

from mongo_outbox._storage import CHECKPOINT_AT, FENCE, LEASE_UNTIL, OWNER, TOKEN
from mongo_outbox.errors import describe
from mongo_outbox.events import utc_now

log = logging.getLogger(__name__)


class LeaseLost(Exception):
    """Another process took this relay name over; this one must stop writing and stand by."""


class FencedLease:
    """The lease on ``name`` in collection ``coll``, and what its holder saves under it.

    Parameters:
        coll: the checkpoint collection (a change-stream relay's or a relay group's).
        name: the relay name, or ``<group>/<partition>`` (the document's ``_id``).
        lease: how long a holder keeps the lease without renewing it.
    """

    def __init__(self, coll: Any, name: str, lease: timedelta) -> None:
        self.coll = coll
        self.name = name
        self.lease = lease
        # Unique per relay object; the host and process id tell an operator who holds the lease.
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        self.fence: int | None = None
        # Loop time at which the last write that set or renewed the lease was sent: the lease
        # in the database runs from then (it is computed before sending), not from the reply.
        self._sent = float("-inf")

    @property
    def held(self) -> bool:
        return self.fence is not None

    @property
    def _mine(self) -> dict[str, Any]:
        return {"_id": self.name, OWNER: self.owner, FENCE: self.fence}

    async def acquire(self) -> bool:
        """Renew the lease if it is ours, or take it once the holder's ran out. Returns whether
        this process holds it now."""
        if self.fence is not None and await self.renew():
            return True
        sent = asyncio.get_running_loop().time()
        now = utc_now()
        fence = {"$add": [{"$ifNull": ["$" + FENCE, 0]}, 1]}
        try:
            doc = await self.coll.find_one_and_update(
                # Or still ours: a take-over whose answer was lost (its command bounded, the
                # reply never came) left the lease to this owner with a fence it never learnt;
                # waiting for it to run out would keep every relay off it for a lease.
                {
                    "_id": self.name,
                    "$or": [{LEASE_UNTIL: {"$not": {"$gt": now}}}, {OWNER: self.owner}],
                },
                [
                    {
                        "$set": {
                            OWNER: self.owner,
                            LEASE_UNTIL: {"$literal": now + self.lease},
                            FENCE: {"$max": [fence, int(now.timestamp() * 1000)]},
                        }
                    }
                ],
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
        except DuplicateKeyError:
            # The document exists with a live lease, so the upsert collided: another holds it.
            return False
        self.fence = int(doc[FENCE])
        self._sent = sent
        return True

    async def renew(self) -> bool:
        """Extend the lease if it is still ours; else forget it and return False."""
        if self.fence is None:
            return False
        sent = asyncio.get_running_loop().time()
        renewed = await self.coll.update_one(
            self._mine, {"$set": {LEASE_UNTIL: utc_now() + self.lease}}
        )
        if not renewed.matched_count:
            self.fence = None
        elif self.fence is not None:
            self._sent = max(self._sent, sent)
        return self.fence is not None

    @contextlib.asynccontextmanager
    async def renewed(self, margin: float = 0.0) -> AsyncIterator[asyncio.Event]:
        """Renew the lease every third of it in the background while the body runs, however
        long its rounds take. The event it yields is set, and the fence forgotten, once a
        renewal fails, or when eight tenths of the lease passed since the last one that
        succeeded: the holder must then stop publishing, before another may take over.
        ``margin`` (seconds) sets it that much earlier: a relay group's member gives the
        publishes it started the time to end (its ``publish_timeout``) within the lease."""
        lost = asyncio.Event()
        ended = asyncio.Event()
        heartbeat = asyncio.ensure_future(self._renew_until_lost(lost, margin, ended))
        try:
            yield lost
        finally:
            # Told, then cancelled: before 3.12, asyncio.wait_for could swallow a cancellation
            # that came as its renewal ended, and the heartbeat slept on while this waited for
            # it for ever (seen on 3.10: a relay stuck leaving this block). It looks at ``ended``
            # after each wait.
            ended.set()
            heartbeat.cancel()
            # Waited for, not awaited: a second cancellation of ours must not be swallowed.
            await asyncio.wait({heartbeat})

    async def _renew_until_lost(
        self, lost: asyncio.Event, margin: float, ended: asyncio.Event
    ) -> None:
        loop = asyncio.get_running_loop()
        lease = self.lease.total_seconds()
        deadline = self._sent + lease * 0.8 - margin
        while not ended.is_set():
            await asyncio.sleep(max(0.0, min(lease / 3, deadline - loop.time())))
            if ended.is_set():
                return
            left = deadline - loop.time()
            if left <= 0:
                # No renewal got through in time (a slow server, or this process's loop held
                # up): another may take over any moment.
                log.warning(
                    "relay %s: no lease renewal got through within %.1fs of the last: giving "
                    "the lease up",
                    self.name,
                    lease * 0.8 - margin,
                )
                break
            try:
                # A hung connection must not outlast the lease: give up at the deadline.
                if not await asyncio.wait_for(self.renew(), left):
                    break
                deadline = self._sent + lease * 0.8 - margin
            except (PyMongoError, asyncio.TimeoutError) as error:
                log.warning("relay %s: lease renewal failed: %s", self.name, describe(error))
        else:
            return  # ended, the body left: the lease stays the holder's to renew or release
        self.fence = None
        lost.set()

    async def save(self, token: Any) -> None:
        """Store the resume token and renew the lease, in one write fenced on our claim."""
        if self.fence is None:
            raise LeaseLost(f"relay {self.name}: this process does not hold the lease")
        sent = asyncio.get_running_loop().time()
        now = utc_now()
        result = await self.coll.update_one(
            self._mine,
            {"$set": {TOKEN: token, CHECKPOINT_AT: now, LEASE_UNTIL: now + self.lease}},
        )
        if not result.matched_count:
            self.fence = None
            raise LeaseLost(f"relay {self.name}: another process took the lease over")
        self._sent = max(self._sent, sent)

    async def release(self) -> None:
        """Give the lease up at once, so a standby need not wait for it to run out."""
        # By owner, not fence: a renewal that timed out here may still have gone through, and
        # the lease it extended is this process's to give up (owners are unique per object).
        # The owner is cleared too, so that a renewal still in flight (its caller cancelled
        # it, the server had it already) matches nothing once it lands.
        self.fence = None
        await self.coll.update_one(
            {"_id": self.name, OWNER: self.owner},
            {"$set": {LEASE_UNTIL: utc_now(), OWNER: None}},
        )

    async def load(self) -> dict[str, Any]:
        return dict(await self.coll.find_one({"_id": self.name}) or {})
