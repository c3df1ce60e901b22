"""``save_with_events`` against the hand-written writes it replaces, in both outbox modes.

Baselines: collection mode, a ``with_transaction`` holding ``replace_one(upsert)`` of the
aggregate and ``insert_many`` of its outbox entries; embedded mode, one upserting ``update_one``
that sets the document and pushes the entries. A third side writes by hand what the library
writes (one ``findAndModify`` with the update pipeline that keeps ``_version`` and ``_sequence``),
which splits the library's cost into its own code and the shape of its write. In embedded mode
the library reserves no event id (they are its own: the relay takes them before it publishes),
so that side splits the library's cost the same way. All sides build
their documents from the same Event objects inside the timed loop, as an application would.
Every run gets a fresh database (emulator writes cost O(collection size)) and runs alternate,
so drift hits all sides alike.

A last figure per mode is the create path: ``SAVES`` new aggregates saved with
``expected_version=0`` ("must not exist yet"), against the same saves without it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo import ReturnDocument

from benchmarks.common import client, fresh_db, header, median, say, standalone, stored
from mongo_outbox import Event, Outbox

SAVES = 200
AGGREGATES = 50
EVENTS_PER_SAVE = 2
REPEATS = 5
MODES = ("collection", "embedded")

Saver = Callable[[Any, Any, dict[str, Any], list[Event]], Awaitable[None]]


def workload() -> list[tuple[dict[str, Any], list[Event]]]:
    work = []
    for n in range(SAVES):
        key = f"order-{n % AGGREGATES}"
        document = {"_id": key, "customer": f"c{n % 17}", "total": 10 + n, "lines": [n] * 5}
        events = [
            Event(
                type="order.updated",
                payload={"total": 10 + n, "step": step},
                aggregate_type="orders",
                aggregate_id=key,
            )
            for step in range(EVENTS_PER_SAVE)
        ]
        work.append((document, events))
    return work


async def library_save(mode: str) -> Saver:
    async def save(mongo: Any, db: Any, document: dict[str, Any], events: list[Event]) -> None:
        outbox = (
            Outbox(db, mode="embedded", collections=["orders"])
            if mode == "embedded"
            else Outbox(db)
        )
        await outbox.save_with_events(None, db.orders, document, events)

    return save


async def baseline_save(mode: str) -> Saver:
    async def transaction(
        mongo: Any, db: Any, document: dict[str, Any], events: list[Event]
    ) -> None:
        entries = [
            stored(e, "_id") | {"status": "pending", "available_at": e.occurred_at, "attempts": 0}
            for e in events
        ]

        async def write(session: Any) -> None:
            await db.orders.replace_one(
                {"_id": document["_id"]}, document, upsert=True, session=session
            )
            await db.outbox.insert_many(entries, session=session)

        async with mongo.start_session() as session:
            await session.with_transaction(write)

    async def update(mongo: Any, db: Any, document: dict[str, Any], events: list[Event]) -> None:
        entries = [stored(e, "id") for e in events]
        body = {k: v for k, v in document.items() if k != "_id"}
        await db.orders.update_one(
            {"_id": document["_id"]},
            {
                "$set": {**body, "_outbox_due": entries[0]["occurred_at"]},
                "$push": {"_outbox": {"$each": entries}},
            },
            upsert=True,
        )

    return update if mode == "embedded" else transaction


def versioned(body: dict[str, Any], entries: list[dict[str, Any]], embedded: bool) -> list[Any]:
    """The library's update pipeline, written out: replace the document, bump the counters."""
    sets: dict[str, Any] = {
        "_version": {"$add": [{"$ifNull": ["$_version", 0]}, 1]},
        "_sequence": {"$add": [{"$ifNull": ["$_sequence", 0]}, len(entries)]},
    }
    if embedded:
        base = {"$ifNull": ["$_sequence", 0]}
        stamped = [
            {"$mergeObjects": [{"$literal": e}, {"sequence": {"$add": [base, i]}}]}
            for i, e in enumerate(entries, start=1)
        ]
        sets["_outbox"] = {"$concatArrays": [{"$ifNull": ["$_outbox", []]}, stamped]}
        sets["_outbox_due"] = {"$ifNull": ["$_outbox_due", entries[0]["occurred_at"]]}
        sets["_outbox_claim"] = "$_outbox_claim"
    return [{"$replaceWith": {"$mergeObjects": [{"$literal": body}, sets]}}]


async def same_shape_save(mode: str) -> Saver:
    async def save(mongo: Any, db: Any, document: dict[str, Any], events: list[Event]) -> None:
        embedded = mode == "embedded"
        entries = [stored(e, "id" if embedded else "_id") for e in events]

        async def write(session: Any) -> None:
            stored = await db.orders.find_one_and_update(
                {"_id": document["_id"]},
                versioned(document, entries, embedded),
                upsert=True,
                projection={"_version": 1, "_sequence": 1},
                return_document=ReturnDocument.AFTER,
                session=session,
            )
            if not embedded:
                first = stored["_sequence"] - len(entries) + 1
                await db.outbox.insert_many(
                    [
                        e
                        | {"sequence": first + i, "status": "pending", "attempts": 0}
                        | {"available_at": e["occurred_at"]}
                        for i, e in enumerate(entries)
                    ],
                    session=session,
                )

        if embedded:
            await write(None)
            return
        async with mongo.start_session() as session:
            await session.with_transaction(write)

    return save


async def one_run(mongo: Any, save: Saver) -> float:
    """Seconds per save, over SAVES saves into a fresh database."""
    work = workload()
    async with fresh_db(mongo) as db:
        # Create the collections first: a transaction creating one is slower and not what
        # a running service does.
        await db.create_collection("orders")
        await db.create_collection("outbox")
        start = time.perf_counter()
        for document, events in work:
            await save(mongo, db, document, events)
        return (time.perf_counter() - start) / SAVES


def creations() -> list[tuple[dict[str, Any], list[Event]]]:
    return [
        ({"_id": f"new-{n}", "customer": f"c{n % 17}", "total": n}, [Event(type="order.placed")])
        for n in range(SAVES)
    ]


async def one_create_run(mongo: Any, mode: str, expected_version: int | None) -> float:
    """Seconds per save, over SAVES saves that each create a new aggregate."""
    work = creations()
    async with fresh_db(mongo) as db:
        await db.create_collection("orders")
        await db.create_collection("outbox")
        outbox = (
            Outbox(db, mode="embedded", collections=["orders"])
            if mode == "embedded"
            else Outbox(db)
        )
        start = time.perf_counter()
        for document, events in work:
            await outbox.save_with_events(
                None, db.orders, document, events, expected_version=expected_version
            )
        return (time.perf_counter() - start) / SAVES


async def measure_create(mongo: Any, mode: str) -> str:
    seconds: dict[int | None, list[float]] = {0: [], None: []}
    for repeat in range(REPEATS):
        for expected in (0, None) if repeat % 2 == 0 else (None, 0):
            seconds[expected].append(await one_create_run(mongo, mode, expected))
    create, upsert = median(seconds[0]), median(seconds[None])
    line = (
        f"{mode:<10} create (expected_version=0) {create * 1000:6.2f} ms/save  "
        f"vs without expected_version {upsert * 1000:6.2f} ms  ratio {create / upsert:.2f}"
    )
    say(line)
    return line


async def measure(mongo: Any, mode: str) -> list[str]:
    sides = {
        "library": await library_save(mode),
        "baseline": await baseline_save(mode),
        "same shape": await same_shape_save(mode),
    }
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(REPEATS):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            seconds[name].append(await one_run(mongo, sides[name]))
    library, baseline, shape = (median(seconds[name]) for name in sides)
    what = "update_one(upsert, $push)" if mode == "embedded" else "replace_one + insert_many txn"
    by_hand = "same write by hand (findAndModify pipeline)"
    lines = [
        f"{mode:<10} save_with_events {library * 1000:6.2f} ms/save",
        f"{mode:<10}   vs {'baseline ' + what:<55} {baseline * 1000:6.2f} ms  "
        f"ratio {library / baseline:.2f}",
        f"{mode:<10}   vs {by_hand:<55} {shape * 1000:6.2f} ms  ratio {library / shape:.2f}",
    ]
    for line in lines:
        say(line)
    return [*lines, await measure_create(mongo, mode)]


async def run(uri: str) -> list[str]:
    header(
        f"save_with_events vs hand-written writes: {SAVES} saves over {AGGREGATES} aggregates, "
        f"{EVENTS_PER_SAVE} events each, median of {REPEATS} alternating runs"
    )
    mongo = client(uri)
    try:
        return [line for mode in MODES for line in await measure(mongo, mode)]
    finally:
        await mongo.close()


if __name__ == "__main__":
    standalone(run)
