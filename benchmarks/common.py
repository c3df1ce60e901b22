"""Helpers the benchmarks share: which MongoDB they run on, command counting, names, timing.

Benchmarks print figures and ratios to a baseline measured in the same run; they never assert
timings, because the machine they run on (often shared, often the emulator) decides those.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from pymongo import AsyncMongoClient, uri_parser
from pymongo.monitoring import (
    CommandFailedEvent,
    CommandListener,
    CommandStartedEvent,
    CommandSucceededEvent,
)

from mongo_outbox import Event
from mongo_outbox.testing import start_emulator

NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")

# Commands the driver sends on its own schedule, not on the code under measurement's behalf.
_BACKGROUND = frozenset(
    {"hello", "ismaster", "isMaster", "ping", "endSessions", "saslStart", "saslContinue"}
)


class Backend(Protocol):
    uri: str
    description: str

    def stop(self) -> None: ...


@dataclass
class GivenMongo:
    """The MongoDB at ``MONGODB_URI``: running before the benchmarks, and after them."""

    uri: str
    description: str

    def stop(self) -> None:
        pass


def start_backend() -> Backend:
    """``MONGODB_URI`` if set, else the mongoeco emulator (``mongo_outbox.testing``)."""
    uri = os.environ.get("MONGODB_URI")
    if uri:
        hosts = ",".join(f"{host}:{port}" for host, port in uri_parser.parse_uri(uri)["nodelist"])
        return GivenMongo(uri, f"MONGODB_URI ({hosts})")
    return start_emulator()


class CommandCounter(CommandListener):
    """Counts the commands a client sends, by name (find, update, getMore, ...)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def started(self, event: CommandStartedEvent) -> None:
        if event.command_name not in _BACKGROUND:
            self.counts[event.command_name] += 1

    def succeeded(self, event: CommandSucceededEvent) -> None:
        pass

    def failed(self, event: CommandFailedEvent) -> None:
        pass

    def reset(self) -> None:
        self.counts.clear()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def breakdown(self) -> str:
        return " ".join(f"{name}={n}" for name, n in sorted(self.counts.items()))


def client(uri: str, *listeners: CommandListener) -> AsyncMongoClient[Any]:
    return AsyncMongoClient(uri, tz_aware=True, event_listeners=list(listeners))


def unique(prefix: str = "bench") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


@asynccontextmanager
async def fresh_db(mongo: AsyncMongoClient[Any]) -> AsyncIterator[Any]:
    """A database of its own, dropped afterwards: emulator writes cost O(collection size)."""
    name = unique("bench_")
    try:
        yield mongo[name]
    finally:
        await mongo.drop_database(name)


async def timed(work: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await work()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def header(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def say(line: str) -> None:
    print(line, flush=True)


def standalone(run: Callable[[str], Awaitable[list[str]]]) -> None:
    """Run one benchmark module on its own: ``python -m benchmarks.bench_x``."""

    async def main() -> None:
        server = start_backend()
        say(f"MongoDB: {server.description}")
        try:
            await run(server.uri)
        finally:
            server.stop()

    asyncio.run(main())


def stored(event: Event, id_key: str) -> dict[str, Any]:
    """``event`` as a hand-written write stores it, with the same fields as the library's entry:
    the id under ``id_key``, and no field that holds its default (None, no headers)."""
    data = event.model_dump(exclude_none=True)
    if not data["headers"]:
        del data["headers"]
    data[id_key] = data.pop("id")
    return data
