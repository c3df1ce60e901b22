"""Creating aggregates: the peer-comparison workload, against a hand-written insert baseline.

The workload is the one the peer comparison used (issue 12): ``ORDERS`` new orders, each saved
in a transaction of its own with one event, in collection mode. The comparison there measured
mongo-outbox at 29.0 s and event-forge at 20.2 s on the same emulator. event-forge cannot be
installed here, so the peer is stood in for by what it does, written by hand: per order, a
``with_transaction`` holding ``insert_one`` of the order and ``insert_one`` of its outbox
document (the event's fields, ``status``, ``available_at``, ``attempts``), with no version or
sequence kept and no checks. That is the cheapest correct way to write this workload with
PyMongo, so a ratio of 1.0 or below means creating costs no more than plain inserts.

Sides: ``save_with_events(..., expected_version=0)`` (a create: one ``insert_one`` of the
document, one of the entry, the commit: the same three commands as the baseline), the same
without ``expected_version`` (an upsert: one ``findAndModify`` with an update pipeline, which
also creates), and the baseline. Each side writes into a fresh database of its own, and every
order goes through the three sides in turn (a rotating order), so the shared machine's drift and
each database's growth (emulator writes cost O(collection size)) hit all sides alike.

The orders run in ``BLOCKS`` consecutive blocks (interleaved repeats of the same comparison):
each block gives a ratio to the baseline, and the headline is the median of those ratios, which
a burst of load on a shared machine during one block cannot move; the ratio of the totals and
the range of the block ratios are printed beside it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.common import client, fresh_db, header, median, say, standalone, stored
from mongo_outbox import Event, Outbox
from mongo_outbox.events import utc_now

ORDERS = int(os.environ.get("BENCH_CREATE_ORDERS", "2000"))
BLOCKS = 20

Create = Callable[[Any, dict[str, Any], Event], Awaitable[None]]


def orders() -> list[tuple[dict[str, Any], Event]]:
    return [
        (
            {"_id": f"order-{n}", "customer": f"c{n % 17}", "total": 10 + n % 90, "lines": [n]},
            Event(type="order.placed", payload={"total": 10 + n % 90}),
        )
        for n in range(ORDERS)
    ]


def library(expected_version: int | None) -> Create:
    outboxes: dict[str, Outbox] = {}  # one per database, built once as a service does

    async def create(db: Any, order: dict[str, Any], event: Event) -> None:
        outbox = outboxes.get(db.name) or outboxes.setdefault(db.name, Outbox(db))
        await outbox.save_with_events(
            None, db.orders, order, [event], expected_version=expected_version
        )

    return create


async def by_hand(db: Any, order: dict[str, Any], event: Event) -> None:
    data = stored(event, "_id") | {"aggregate_type": "orders", "aggregate_id": order["_id"]}
    entry = data | {"status": "pending", "available_at": utc_now(), "attempts": 0}

    async def write(session: Any) -> None:
        await db.orders.insert_one(order, session=session)
        await db.outbox.insert_one(entry, session=session)

    async with db.client.start_session() as session:
        await session.with_transaction(write)


async def run(uri: str) -> list[str]:
    header(
        f"creating aggregates: {ORDERS} orders, each in its own transaction with one event "
        "(collection mode), the sides interleaved order by order"
    )
    sides = {
        "save_with_events(expected_version=0)": library(0),
        "save_with_events (upsert)": library(None),
        "hand-written inserts (the peer's way)": by_hand,
    }
    mongo = client(uri)
    try:
        async with fresh_db(mongo) as a, fresh_db(mongo) as b, fresh_db(mongo) as c:
            dbs = dict(zip(sides, (a, b, c), strict=True))
            for db in dbs.values():
                await db.create_collection("orders")
                await db.create_collection("outbox")
                await Outbox(db).ensure_indexes()  # every side writes next to the relay's indexes
            names = list(sides)
            blocks: list[dict[str, float]] = []
            per_block = max(1, ORDERS // BLOCKS)
            for n, (order, event) in enumerate(orders()):
                if n % per_block == 0:
                    blocks.append(dict.fromkeys(sides, 0.0))
                # Each order goes through every side, in a rotating order: the machine's drift
                # and each database's growth hit all sides alike.
                for name in names[n % 3 :] + names[: n % 3]:
                    start = time.perf_counter()
                    await sides[name](dbs[name], dict(order), event)
                    blocks[-1][name] += time.perf_counter() - start
        base = "hand-written inserts (the peer's way)"
        lines = []
        for name in sides:
            total = sum(block[name] for block in blocks)
            ratios = [block[name] / block[base] for block in blocks]
            lines.append(
                f"{name:<40} {total:6.1f} s  ratio {median(ratios):.3f} to inserts (median of "
                f"{len(blocks)} blocks, {min(ratios):.2f}-{max(ratios):.2f}; totals "
                f"{total / sum(block[base] for block in blocks):.3f})"
            )
        for line in lines:
            say(line)
        return lines
    finally:
        await mongo.close()


if __name__ == "__main__":
    standalone(run)
