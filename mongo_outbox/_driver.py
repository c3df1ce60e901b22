"""What differs between PyMongo's async API and Motor, in one place."""

from __future__ import annotations

import inspect
from typing import Any

from pymongo.asynchronous.database import AsyncDatabase
from pymongo.synchronous.database import Database

DUPLICATE_KEY = 11000  # DuplicateKey, in a bulk write's writeErrors


def is_async(db: Any) -> bool | None:
    """Whether ``db`` is PyMongo's ``AsyncDatabase`` or Motor's (True), PyMongo's sync
    ``Database`` (False), or neither (None: a stand-in, taken as it is)."""
    if isinstance(db, AsyncDatabase) or type(db).__module__.startswith("motor."):
        return True
    if isinstance(db, Database):
        return False
    return None


async def start_session(client: Any) -> Any:
    """A new session of ``client``, to be used with ``async with``."""
    session = client.start_session()
    # Motor's start_session is a coroutine, PyMongo's returns the session.
    return await session if inspect.isawaitable(session) else session


async def aggregate(collection: Any, pipeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run an aggregation and return its documents."""
    cursor = collection.aggregate(pipeline)
    # PyMongo's async aggregate is a coroutine that returns the cursor; Motor's is the cursor.
    if inspect.isawaitable(cursor):
        cursor = await cursor
    documents: list[dict[str, Any]] = await cursor.to_list(None)
    return documents
