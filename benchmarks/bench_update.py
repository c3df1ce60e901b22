"""``update_with_events`` and the sync API against the hand-written writes they replace.

The workload: ``UPDATES`` updates ``{"$set": {"status": ...}, "$inc": {"total": 1}}`` spread
over ``AGGREGATES`` existing orders, one event each. Every side builds its writes from the same
Event objects (each side its own copy) inside the timed loop, as an application would; every
run gets a fresh database (emulator writes cost O(collection size)), and every update goes
through all sides in turn, in a rotating order, so drift and bursts of load on a shared machine
hit all sides alike.

Baselines, as the issue states them:

- collection mode: ``with_transaction`` holding ``update_one`` with the same update and
  ``insert_one`` of the outbox entry. It numbers nothing: the library's ``findAndModify`` also
  moves ``_version``/``_sequence`` and returns them, so the entry carries its sequence.
- embedded mode: one ``update_one`` with the same update, ``$push`` of the entry and ``$set`` of
  the due time. The library's update is one ``findAndModify`` too (the entry pushed unnumbered,
  the counters moved by ``$inc``, the due time by ``$max``). Its events' ids are the library's
  own, so it reserves none in the registry (the relay takes them before it publishes); a
  by-hand side that adds a registry insert shows what reserving an id the caller chose costs,
  and a library side with the same change as a pipeline update the other way to write it.
- the sync API: the same baselines written with PyMongo's sync client.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo import MongoClient

from benchmarks.common import client, fresh_db, header, median, say, standalone, stored, unique
from mongo_outbox import Event, Outbox
from mongo_outbox.events import utc_now
from mongo_outbox.sync import Outbox as SyncOutbox

UPDATES = 200
AGGREGATES = 50
REPEATS = 5

Side = Callable[[Any, str, dict[str, Any], Event], Awaitable[None]]
"""One update: (database, order id, update, event)."""


def workload() -> list[tuple[str, dict[str, Any], Event]]:
    return [
        (
            f"order-{n % AGGREGATES}",
            {"$set": {"status": f"s{n % 7}"}, "$inc": {"total": 1}},
            Event(type="order.updated", payload={"n": n}, aggregate_type="orders"),
        )
        for n in range(UPDATES)
    ]


def entry(event: Event, id_key: str, key: str) -> dict[str, Any]:
    return stored(event, id_key) | {"aggregate_id": key}


def as_pipeline(update: dict[str, Any]) -> list[dict[str, Any]]:
    """The workload's update as a pipeline stage: the same change."""
    sets = {k: {"$literal": v} for k, v in update["$set"].items()}
    sets |= {k: {"$add": [{"$ifNull": [f"${k}", 0]}, v]} for k, v in update["$inc"].items()}
    return [{"$set": sets}]


def outbox_options(mode: str) -> dict[str, Any]:
    return {"mode": mode, "collections": ["orders"]} if mode == "embedded" else {}


def library(mode: str, pipeline: bool = False) -> Side:
    outboxes: dict[str, Outbox] = {}  # one per database, built once as a service does

    async def update(db: Any, key: str, change: dict[str, Any], event: Event) -> None:
        outbox = outboxes.get(db.name) or outboxes.setdefault(
            db.name, Outbox(db, **outbox_options(mode))
        )
        doc = as_pipeline(change) if pipeline else change
        await outbox.update_with_events(None, db.orders, {"_id": key}, doc, [event])

    return update


def by_hand(mode: str, registry: bool = False) -> Side:
    async def transaction(db: Any, key: str, change: dict[str, Any], event: Event) -> None:
        pending = {"status": "pending", "available_at": utc_now(), "attempts": 0}

        async def write(session: Any) -> None:
            await db.orders.update_one({"_id": key}, change, session=session)
            await db.outbox.insert_one(entry(event, "_id", key) | pending, session=session)

        async with db.client.start_session() as session:
            await session.with_transaction(write)

    async def pushed(db: Any, key: str, change: dict[str, Any], event: Event) -> None:
        if registry:
            reservation = {"_id": event.id, "collection": "orders", "aggregate": key}
            await db.outbox_event_ids.insert_one(reservation)
        await db.orders.update_one(
            {"_id": key},
            {
                "$set": change["$set"] | {"_outbox_due": utc_now()},
                "$inc": change["$inc"],
                "$push": {"_outbox": entry(event, "id", key)},
            },
        )

    return pushed if mode == "embedded" else transaction


def sync_library(mongo: MongoClient[Any], mode: str) -> Side:
    outboxes: dict[str, SyncOutbox] = {}

    async def update(db: Any, key: str, change: dict[str, Any], event: Event) -> None:
        sync_db = mongo[db.name]
        outbox = outboxes.get(db.name) or outboxes.setdefault(
            db.name, SyncOutbox(sync_db, **outbox_options(mode))
        )
        outbox.update_with_events(None, sync_db.orders, {"_id": key}, change, [event])

    return update


def sync_by_hand(mongo: MongoClient[Any], mode: str, registry: bool = False) -> Side:
    async def update(db: Any, key: str, change: dict[str, Any], event: Event) -> None:
        sync_db = mongo[db.name]
        if registry:
            reservation = {"_id": event.id, "collection": "orders", "aggregate": key}
            sync_db.outbox_event_ids.insert_one(reservation)
        if mode == "embedded":
            sync_db.orders.update_one(
                {"_id": key},
                {
                    "$set": change["$set"] | {"_outbox_due": utc_now()},
                    "$inc": change["$inc"],
                    "$push": {"_outbox": entry(event, "id", key)},
                },
            )
            return
        pending = {"status": "pending", "available_at": utc_now(), "attempts": 0}

        def write(session: Any) -> None:
            sync_db.orders.update_one({"_id": key}, change, session=session)
            sync_db.outbox.insert_one(entry(event, "_id", key) | pending, session=session)

        with mongo.start_session() as session:
            session.with_transaction(write)

    return update


async def seeded(db: Any) -> None:
    for name in ("orders", "outbox", "outbox_event_ids"):
        await db.create_collection(name)
    await db.orders.insert_many(
        [
            {"_id": f"order-{n}", "total": 0, "_version": 1, "_sequence": 0}
            for n in range(AGGREGATES)
        ]
    )


async def one_run(mongo: Any, sides: dict[str, Side]) -> dict[str, float]:
    """Seconds per update of each side, over UPDATES updates of existing orders, each side in a
    fresh database of its own; every update goes through all sides in turn (a rotating order),
    so a burst of load on a shared machine hits them alike."""
    work = workload()
    names = list(sides)
    seconds = dict.fromkeys(names, 0.0)
    async with contextlib.AsyncExitStack() as stack:
        dbs = {name: await stack.enter_async_context(fresh_db(mongo)) for name in names}
        for db in dbs.values():
            await seeded(db)
        for n, (key, change, event) in enumerate(work):
            for name in names[n % len(names) :] + names[: n % len(names)]:
                # Its own copy of the event (the same id, in another database): an Event object
                # saved to one document is refused for another (docs/outbox.md).
                mine = event.model_copy()
                start = time.perf_counter()
                await sides[name](dbs[name], key, change, mine)
                seconds[name] += time.perf_counter() - start
    return {name: total / UPDATES for name, total in seconds.items()}


async def compare(mongo: Any, title: str, sides: dict[str, Side]) -> list[str]:
    """Seconds per update of each side (median of REPEATS runs), and the first side's ratio to
    each other one: the median of the per-run ratios (the first other side is the issue's
    baseline)."""
    runs = [await one_run(mongo, sides) for _ in range(REPEATS)]
    names = list(sides)
    mine = median([run[names[0]] for run in runs])
    lines = [f"{title}: {names[0]} {mine * 1000:6.2f} ms/update"]
    for name in names[1:]:
        ratios = [run[names[0]] / run[name] for run in runs]
        lines.append(
            f"  vs {name:<52} {median([run[name] for run in runs]) * 1000:6.2f} ms  "
            f"ratio {median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        )
    for line in lines:
        say(line)
    return lines


async def run(uri: str) -> list[str]:
    header(
        f"update_with_events ($set + $inc, one event) vs hand-written writes: {UPDATES} updates "
        f"over {AGGREGATES} orders, sides interleaved update by update, median of {REPEATS} runs"
    )
    mongo = client(uri)
    sync_mongo: MongoClient[Any] = MongoClient(uri, tz_aware=True, appname=unique("sync"))
    try:
        lines = await compare(
            mongo,
            "collection",
            {
                "update_with_events": library("collection"),
                "update_one + insert_one in a transaction": by_hand("collection"),
            },
        )
        lines += await compare(
            mongo,
            "embedded",
            {
                "update_with_events": library("embedded"),
                "update_one with $push": by_hand("embedded"),
                "registry insert + update_one with $push": by_hand("embedded", registry=True),
                "update_with_events, the same as a pipeline": library("embedded", pipeline=True),
            },
        )
        for mode in ("collection", "embedded"):
            what = "update_one with $push" if mode == "embedded" else "update_one + insert_one txn"
            sides = {
                "sync update_with_events": sync_library(sync_mongo, mode),
                f"sync {what}": sync_by_hand(sync_mongo, mode),
            }
            if mode == "embedded":
                sides[f"sync registry insert + {what}"] = sync_by_hand(sync_mongo, mode, True)
            lines += await compare(mongo, f"sync {mode}", sides)
        return lines
    finally:
        sync_mongo.close()
        await mongo.close()


if __name__ == "__main__":
    standalone(run)
