"""Both write APIs behind one test interface: ``mongo_outbox.Outbox`` as it is, and
``mongo_outbox.sync.Outbox`` over a ``MongoClient`` of the same server, its calls run in a
worker thread and given the sync client's collection of the same name. So one test body checks
both APIs against the same database."""

from __future__ import annotations

import asyncio
from typing import Any

from pymongo import MongoClient

from mongo_outbox import Outbox, Saved
from mongo_outbox import sync as outbox_sync

APIS = ["async", "sync"]


class Writer:
    """The ``api`` (``"async"`` or ``"sync"``) outbox over ``db``, called with ``await``."""

    def __init__(self, api: str, db: Any, sync_client: MongoClient[Any], **options: Any) -> None:
        self.api = api
        self.db = db
        self.sync_db = sync_client[db.name]
        self.outbox: Any = (
            Outbox(db, **options) if api == "async" else outbox_sync.Outbox(self.sync_db, **options)
        )
        # The relays are async whichever API saved: they get an async Outbox of the same layout.
        self.relay_outbox = Outbox(db, **options)

    def _collection(self, collection: Any) -> Any:
        return collection if self.api == "async" else self.sync_db[collection.name]

    async def _call(self, name: str, session: Any, collection: Any, *args: Any, **kw: Any) -> Any:
        method = getattr(self.outbox, name)
        if self.api == "async":
            return await method(session, collection, *args, **kw)
        return await asyncio.to_thread(method, session, self._collection(collection), *args, **kw)

    async def ensure_indexes(self) -> None:
        if self.api == "async":
            await self.outbox.ensure_indexes()
        else:
            await asyncio.to_thread(self.outbox.ensure_indexes)

    async def save_with_events(self, session: Any, collection: Any, *args: Any, **kw: Any) -> Saved:
        result: Saved = await self._call("save_with_events", session, collection, *args, **kw)
        return result

    async def update_with_events(
        self, session: Any, collection: Any, *args: Any, **kw: Any
    ) -> Saved:
        result: Saved = await self._call("update_with_events", session, collection, *args, **kw)
        return result

    async def delete_with_events(
        self, session: Any, collection: Any, *args: Any, **kw: Any
    ) -> Saved:
        result: Saved = await self._call("delete_with_events", session, collection, *args, **kw)
        return result

    async def add_events(self, session: Any, collection: Any, *args: Any, **kw: Any) -> Saved:
        result: Saved = await self._call("add_events", session, collection, *args, **kw)
        return result
