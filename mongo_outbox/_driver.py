"""What differs between PyMongo's async API and Motor, in one place."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import Any, TypeVar

from pymongo.asynchronous.collection import AsyncCollection
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.asynchronous.mongo_client import AsyncMongoClient
from pymongo.errors import NetworkTimeout
from pymongo.synchronous.collection import Collection
from pymongo.synchronous.database import Database
from pymongo.synchronous.mongo_client import MongoClient

from mongo_outbox._deadlines import within

DUPLICATE_KEY = 11000  # DuplicateKey, in a bulk write's writeErrors

T = TypeVar("T")


_KINDS: tuple[tuple[tuple[type, ...], str], ...] = (
    ((Database, AsyncDatabase), "database"),
    ((Collection, AsyncCollection), "collection"),
    ((MongoClient, AsyncMongoClient), "client"),
)


def driver_kind(value: Any) -> str | None:
    """``"database"``, ``"collection"`` or ``"client"`` when ``value`` is one of PyMongo's
    (either API) or Motor's; else None. Each answers any attribute with a sub-object (a
    collection ``db.name``, a database), so one passed for another is found out only here,
    not by its attributes."""
    motor = type(value).__module__.startswith("motor.")
    for classes, kind in _KINDS:
        if isinstance(value, classes) or (motor and type(value).__name__.endswith(kind.title())):
            return kind
    return None


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


async def answered(commands: Awaitable[T], seconds: float) -> T:
    """``commands``' result, or ``NetworkTimeout`` once they took ``seconds``: for commands on a
    connection that hung without a reset (a stalled NAT or firewall, a half-open socket), which
    PyMongo would wait on for ever without ``socketTimeoutMS``. Cancelled, PyMongo closes the
    connection. Not ``pymongo.timeout()``: it would also replace the client's own
    ``serverSelectionTimeoutMS`` with ``seconds`` (a stop during an outage waited that long) and
    not reach Motor's threads."""
    try:
        return await within(commands, seconds)
    except asyncio.TimeoutError as error:
        raise NetworkTimeout(f"MongoDB gave no answer within {seconds:g} s") from error
