"""A writer process that kills itself (SIGKILL) right after an embedded save reserved its event
ids in the registry, before the document write: the crash between the two steps of a save.

Usage: python -m tests.crash.writer_process URI DB EVENT_ID
It saves ``{"_id": 1}`` into ``orders`` with one event of id EVENT_ID.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from pymongo import AsyncMongoClient

from mongo_outbox import Event, Outbox
from tests.support.crash import KillAfterWrite


async def main(uri: str, db_name: str, event_id: str) -> None:
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    db = client[db_name]
    outbox = Outbox(db, mode="embedded", collections=["orders"])
    outbox._registry.registry = KillAfterWrite(outbox.event_ids, "insert_many")
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(id=event_id, type="a")])
    raise SystemExit("the save finished without reaching its kill point")


if __name__ == "__main__":
    uri, db_name, event_id = sys.argv[1:]
    asyncio.run(main(uri, db_name, event_id))
