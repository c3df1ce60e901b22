"""Creating aggregates: the peer-comparison workload, against the peer and a hand-written baseline.

The workload is the one the peer comparison used (issue 12): ``ORDERS`` new orders, each saved
in a transaction of its own with one event, in collection mode. The comparison there measured
mongo-outbox at 29.0 s and event-forge at 20.2 s on the same emulator.

Sides, each writing into a fresh database of its own:

- ``save_with_events(..., expected_version=0)`` on PyMongo's async client: a create, one
  ``insert_one`` of the document, one of the entry, the commit;
- the same without ``expected_version``: an upsert, one ``findAndModify`` with an update
  pipeline, which also creates;
- the create on Motor, the driver the peer runs on;
- the peer: event-forge (PyPI ``event-forge``, in the ``dev`` extra), its Motor outbox
  repository's ``create`` beside the order's ``insert_one`` in its own ``with_transaction``, as
  its documentation writes it; left out, with a line that says so, when it is not installed;
- by hand: per order, a ``with_transaction`` holding ``insert_one`` of the order and
  ``insert_one`` of its outbox document (the event's fields, ``status``, ``available_at``,
  ``attempts``), with no version or sequence kept and no checks: the cheapest correct way to
  write this workload with PyMongo, a stricter baseline than any library.

Every order goes through all sides in turn (a rotating order), so the shared machine's drift and
each database's growth (emulator writes cost O(collection size)) hit all sides alike. The orders
run in ``BLOCKS`` consecutive blocks: each block gives a ratio, and the headline is the median of
those ratios, which a burst of load during one block cannot move; the ratio of the totals and
the range of the block ratios are printed beside it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from motor.motor_asyncio import AsyncIOMotorClient

from benchmarks.common import client, fresh_db, header, median, say, standalone, stored
from mongo_outbox import Event, Outbox
from mongo_outbox.events import utc_now

try:  # the peer, in the dev extra; left out of the comparison when it is not installed
    from event_forge.models import CreateOutboxMessageDto
    from event_forge.repositories.motor import MotorOutboxRepository
except ImportError:
    MotorOutboxRepository = None

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


def peer() -> Create | None:
    """event-forge writing the workload through its Motor repository; None if not installed."""
    if MotorOutboxRepository is None:
        return None
    repositories: dict[str, Any] = {}

    async def create(db: Any, order: dict[str, Any], event: Event) -> None:
        repository = repositories.get(db.name) or repositories.setdefault(
            db.name, MotorOutboxRepository(db.client, db.name)
        )
        message = CreateOutboxMessageDto(
            aggregate_type="orders",
            aggregate_id=order["_id"],
            event_type=event.type,
            payload=event.payload,
        )

        async def write(session: Any) -> None:
            await db.orders.insert_one(order, session=session)
            await repository.create(message, session)

        await repository.with_transaction(write)

    return create


async def by_hand(db: Any, order: dict[str, Any], event: Event) -> None:
    data = stored(event, "_id") | {"aggregate_type": "orders", "aggregate_id": order["_id"]}
    entry = data | {"status": "pending", "available_at": utc_now(), "attempts": 0}

    async def write(session: Any) -> None:
        await db.orders.insert_one(order, session=session)
        await db.outbox.insert_one(entry, session=session)

    async with db.client.start_session() as session:
        await session.with_transaction(write)


CREATE = "save_with_events(expected_version=0)"
ON_MOTOR = "save_with_events(expected_version=0), Motor"
PEER = "event-forge 1.5 (Motor)"
BY_HAND = "hand-written inserts"


async def run(uri: str) -> list[str]:
    header(
        f"creating aggregates: {ORDERS} orders, each in its own transaction with one event "
        "(collection mode), the sides interleaved order by order"
    )
    sides: dict[str, Create] = {
        CREATE: library(0),
        "save_with_events (upsert)": library(None),
        ON_MOTOR: library(0),
    }
    theirs = peer()
    if theirs is None:
        say("event-forge is not installed (pip install event-forge): the peer is left out")
    else:
        sides[PEER] = theirs
    sides[BY_HAND] = by_hand
    on_motor = {ON_MOTOR, PEER}
    mongo = client(uri)
    motor: AsyncIOMotorClient[dict[str, Any]] = AsyncIOMotorClient(uri, tz_aware=True)
    try:
        async with contextlib.AsyncExitStack() as stack:
            dbs = {}
            for name in sides:
                db = await stack.enter_async_context(fresh_db(mongo))
                await db.create_collection("orders")
                await db.create_collection("outbox")
                await Outbox(db).ensure_indexes()  # every side writes next to the relay's indexes
                dbs[name] = motor[db.name] if name in on_motor else db
            if theirs is not None:  # the peer's own indexes, as its documentation creates them
                await MotorOutboxRepository(motor, dbs[PEER].name).ensure_indexes()
            blocks = await interleaved(sides, dbs)
        return report(blocks, list(sides), theirs is not None)
    finally:
        motor.close()
        await mongo.close()


async def interleaved(sides: dict[str, Create], dbs: dict[str, Any]) -> list[dict[str, float]]:
    """Seconds per side in each block of orders; every order goes through every side."""
    names = list(sides)
    blocks: list[dict[str, float]] = []
    per_block = max(1, ORDERS // BLOCKS)
    for n, (order, event) in enumerate(orders()):
        if n % per_block == 0:
            blocks.append(dict.fromkeys(sides, 0.0))
        # A rotating order: the machine's drift and each database's growth hit all sides alike.
        for name in names[n % len(names) :] + names[: n % len(names)]:
            start = time.perf_counter()
            await sides[name](dbs[name], dict(order), event.model_copy())
            blocks[-1][name] += time.perf_counter() - start
    return blocks


def report(blocks: list[dict[str, float]], names: list[str], with_peer: bool) -> list[str]:
    def ratio(name: str, base: str) -> str:
        ratios = [block[name] / block[base] for block in blocks]
        totals = sum(b[name] for b in blocks) / sum(b[base] for b in blocks)
        spread = f"blocks {min(ratios):.2f}-{max(ratios):.2f}, totals {totals:.3f}"
        return f"{median(ratios):.3f} ({spread})"

    lines = []
    for name in names:
        line = f"{name:<46}{sum(block[name] for block in blocks):6.1f} s"
        if name != BY_HAND:
            line += f"  ratio {ratio(name, BY_HAND)} to hand-written inserts"
        lines.append(line)
    if with_peer:
        lines.append(f"{CREATE} to the peer: ratio {ratio(CREATE, PEER)}")
        lines.append(f"{ON_MOTOR} to the peer (same driver): ratio {ratio(ON_MOTOR, PEER)}")
    lines.append(f"(median of {len(blocks)} blocks of {ORDERS // len(blocks)} orders)")
    for line in lines:
        say(line)
    return lines


if __name__ == "__main__":
    standalone(run)
