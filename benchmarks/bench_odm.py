"""Saving Beanie documents with their events: ``BeanieOutbox.save`` against Beanie's own
``save()`` with a hand-written outbox insert in the same transaction.

The workload: ``ORDERS`` orders, each saved new with one event, then loaded-and-changed orders
saved again with one event (``ROUNDS`` rounds over them), collection mode, every save in a
transaction of its own. Sides, each on a fresh database and a Beanie model class of its own:

- ``BeanieOutbox.save(order, [event])``: Beanie's validation and actions, then one
  ``findAndModify`` (the ``$set`` Beanie's save sends, with the counters' ``$inc``), the entry's
  insert, the commit;
- by hand: in ``session.with_transaction``, ``order.save(session=...)`` (Beanie's own
  ``findAndModify`` upsert) and ``insert_one`` of the outbox entry (the same fields as the
  library's), with no version or sequence kept and no checks.

The sides are interleaved save by save in a rotating order, in ``BLOCKS`` blocks; the headline
is the median of the blocks' ratios (a burst of load in one block cannot move it), printed with
the ratio of the totals and the range. The goal is 1.10 or less.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from beanie import Document, init_beanie
from pydantic import Field

from benchmarks.common import client, fresh_db, header, median, say, standalone, stored
from mongo_outbox import Event, Outbox
from mongo_outbox.events import utc_now
from mongo_outbox.odm.beanie import BeanieOutbox

ORDERS = int(os.environ.get("BENCH_ODM_ORDERS", "300"))
ROUNDS = 2
BLOCKS = 10


class Order(Document):
    customer: str = Field(min_length=1)
    total: int = Field(ge=0)
    lines: list[int] = Field(default_factory=list)

    class Settings:
        name = "orders"


class OrderByHand(Document):
    """The same model, bound to the hand-written side's database (a Beanie subclass of Order
    would bind Order there too)."""

    customer: str = Field(min_length=1)
    total: int = Field(ge=0)
    lines: list[int] = Field(default_factory=list)

    class Settings:
        name = "orders"


Save = Callable[[Document, Event], Awaitable[None]]


def integration(outbox: Outbox) -> Save:
    orders = BeanieOutbox(outbox)

    async def save(order: Document, event: Event) -> None:
        await orders.save(order, [event])

    return save


def by_hand(db: Any) -> Save:
    async def save(order: Document, event: Event) -> None:
        async def write(session: Any) -> None:
            await order.save(session=session)
            data = stored(event, "_id") | {
                "aggregate_type": "orders",
                "aggregate_id": str(order.id),
            }
            entry = data | {"status": "pending", "available_at": utc_now(), "attempts": 0}
            await db.outbox.insert_one(entry, session=session)

        async with db.client.start_session() as session:
            await session.with_transaction(write)

    return save


INTEGRATION = "BeanieOutbox.save"
BY_HAND = "Beanie save() + outbox insert_one"


async def run(uri: str) -> list[str]:
    header(
        f"saving Beanie documents: {ORDERS} new orders, then {ROUNDS} rounds of changes, each "
        "save in its own transaction with one event (collection mode), the sides interleaved"
    )
    mongo = client(uri)
    try:
        async with contextlib.AsyncExitStack() as stack:
            mine = await stack.enter_async_context(fresh_db(mongo))
            theirs = await stack.enter_async_context(fresh_db(mongo))
            for db, model in ((mine, Order), (theirs, OrderByHand)):
                await db.create_collection("orders")
                await db.create_collection("outbox")
                await Outbox(db).ensure_indexes()
                await init_beanie(database=db, document_models=[model])
            sides: dict[str, tuple[Any, Save]] = {
                INTEGRATION: (Order, integration(Outbox(mine))),
                BY_HAND: (OrderByHand, by_hand(theirs)),
            }
            blocks = await interleaved(sides)
        return report(blocks)
    finally:
        await mongo.close()


async def interleaved(sides: dict[str, tuple[Any, Save]]) -> list[dict[str, float]]:
    names = list(sides)
    documents: dict[str, list[Any]] = {name: [] for name in names}
    steps = ORDERS * (1 + ROUNDS)
    per_block = max(1, steps // BLOCKS)
    blocks: list[dict[str, float]] = []
    for n in range(steps):
        if n % per_block == 0:
            blocks.append(dict.fromkeys(names, 0.0))
        for name in names[n % len(names) :] + names[: n % len(names)]:
            model, save = sides[name]
            if n < ORDERS:
                order = model(customer=f"c{n % 17}", total=10 + n % 90)
                documents[name].append(order)
            else:
                order = documents[name][n % ORDERS]
                order.total += 1
                order.lines.append(n)
            event = Event(type="order.saved", payload={"total": order.total})
            start = time.perf_counter()
            await save(order, event)
            blocks[-1][name] += time.perf_counter() - start
    return blocks


def report(blocks: list[dict[str, float]]) -> list[str]:
    ratios = [block[INTEGRATION] / block[BY_HAND] for block in blocks]
    totals = sum(b[INTEGRATION] for b in blocks) / sum(b[BY_HAND] for b in blocks)
    lines = [
        f"{name:<36}{sum(block[name] for block in blocks):6.1f} s"
        for name in (INTEGRATION, BY_HAND)
    ]
    lines.append(
        f"{INTEGRATION} to {BY_HAND}: ratio {median(ratios):.3f} (blocks "
        f"{min(ratios):.2f}-{max(ratios):.2f}, totals {totals:.3f}; goal <= 1.10)"
    )
    lines.append(
        f"(median of {len(blocks)} blocks of {ORDERS * (1 + ROUNDS) // len(blocks)} saves)"
    )
    for line in lines:
        say(line)
    return lines


if __name__ == "__main__":
    standalone(run)
