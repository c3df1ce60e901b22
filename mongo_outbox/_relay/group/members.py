"""A relay group's membership: each member's heartbeat document, and the fair share of the
partitions that follows from who is alive.

One document per member in the members collection, ``{_id: member, group, alive_until,
partitions, host, pid, started_at}``, renewed every third of the member lease (at least once a
second). A member whose heartbeat ran out is no longer counted: the others' next beat sees
``N - 1`` members and their shares grow to cover its partitions, which they take once its
partition leases run out too.

The share is a pure function of the live members' ids and ``P``: member ``r`` (by id order)
wants the partitions ``k`` with ``k % N == r``, so each wants ``P // N`` or ``P // N + 1`` of
them, and members that see the same membership want disjoint sets that cover every partition.
Members that see different memberships for a beat may both want one partition: its lease
(``_relay.lease``) still gives it to one at a time.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from mongo_outbox.events import utc_now


def share(members: Sequence[str], me: str, count: int) -> list[int]:
    """The partitions ``me`` should hold among ``members`` (``me`` counted even if absent)."""
    ranked = sorted({*members, me})
    rank = ranked.index(me)
    return [k for k in range(count) if k % len(ranked) == rank]


class Membership:
    """Member ``me`` of relay group ``group``, its heartbeats in ``coll``."""

    def __init__(self, coll: Any, group: str, me: str, lease: timedelta) -> None:
        self.coll = coll
        self.group = group
        self.me = me
        self.lease = lease
        self._started = utc_now()

    async def beat(self, partitions: Sequence[int]) -> list[str]:
        """Renew this member's heartbeat (with the partitions it holds now, for ``status()``)
        and return the ids of the live members, this one included."""
        now = utc_now()
        await self.coll.update_one(
            {"_id": self.me},
            {
                "$set": {
                    "group": self.group,
                    "alive_until": now + self.lease,
                    "partitions": sorted(partitions),
                },
                "$setOnInsert": {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "started_at": self._started,
                },
            },
            upsert=True,
        )
        return sorted({self.me, *[d["_id"] for d in await self.live()]})

    async def live(self) -> list[dict[str, Any]]:
        """The heartbeat documents of the group's live members, by id."""
        cursor = self.coll.find({"group": self.group, "alive_until": {"$gt": utc_now()}})
        return list(await cursor.sort("_id", 1).to_list(None))

    async def leave(self) -> None:
        await self.coll.delete_one({"_id": self.me})
