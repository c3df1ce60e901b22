"""An order service written with Beanie: its documents saved with typed events by BeanieOutbox.

    python examples/beanie_service.py [--orders 30] [--mode embedded]

Orders are Beanie documents: placed with ``insert``, repriced with ``save`` after a change in
memory (guarded by Beanie's ``revision_id``), paid with ``set`` and a line added with ``update``
and update operators; a ``before_event(Insert, Save)`` action keeps the customer's name tidy, as it
would with Beanie's own ``save()``. Every change records an event whose payload is a plain
pydantic model. A relay then publishes everything, and a consumer rebuilds each order's total
from the typed events alone (``payload_as``), without Beanie.

MongoDB: MONGODB_URI, else the mongoeco emulator started here (mongo_outbox.testing, which needs
mongo-outbox[testing] and Python >= 3.13). Events go to an in-memory publisher.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections import defaultdict
from typing import Any

from beanie import Document, Insert, Save, before_event, init_beanie
from pydantic import BaseModel, Field
from pymongo import AsyncMongoClient

from mongo_outbox import Event, Outbox, PollingRelay
from mongo_outbox.odm.beanie import BeanieOutbox
from mongo_outbox.publishers import MemoryPublisher
from mongo_outbox.testing import start_emulator


class OrderPlaced(BaseModel):
    """The events' payloads: plain pydantic models, no Beanie, for consumers to share."""

    customer: str
    total: int


class OrderRepriced(BaseModel):
    total: int


class LineAdded(BaseModel):
    sku: str
    cents: int


class OrderPaid(BaseModel):
    total: int


class Order(Document):
    customer: str = Field(min_length=1)
    total: int = Field(ge=0)
    lines: list[str] = Field(default_factory=list)
    status: str = "new"
    # The outbox's version, loaded by Beanie, kept up to date by BeanieOutbox, never written by
    # Beanie itself (exclude=True).
    version: int = Field(default=0, alias="_version", exclude=True)

    class Settings:
        name = "orders"
        use_revision = True  # Beanie's optimistic concurrency, kept by BeanieOutbox

    @before_event(Insert, Save)
    def tidy(self) -> None:
        self.customer = self.customer.strip().title()


async def serve(orders: BeanieOutbox, count: int) -> None:
    for n in range(count):
        order = Order(customer=f"  customer {n % 7} ", total=1000 + n)
        placed = OrderPlaced(customer=order.customer, total=order.total)
        await orders.insert(order, [Event.of(placed, type="order.placed")])
        if n % 3 == 0:
            order.total -= 100  # a change in memory, saved whole as Beanie's save() does
            await orders.save(order, [Event.of(OrderRepriced(total=order.total), type="repriced")])
        if n % 2 == 0:
            line = LineAdded(sku="gift-wrap", cents=250)
            await orders.update(
                order,
                {"$push": {"lines": line.sku}, "$inc": {"total": line.cents}},  # or Beanie's Push
                events=[Event.of(line, type="order.line_added")],
            )
        if n % 5 != 4:
            await orders.set(
                order,
                {Order.status: "paid"},
                [Event.of(OrderPaid(total=order.total), type="order.paid")],
                expected_version=order.version,  # nobody changed it since we read the total
            )


def rebuild(events: list[Event]) -> dict[Any, int]:
    """The consumer's side: every paid order's total, from the typed events alone."""
    running: dict[Any, int] = {}
    paid: dict[Any, int] = {}
    for event in events:
        if event.type == "order.placed":
            running[event.aggregate_id] = event.payload_as(OrderPlaced).total
        elif event.type == "repriced":
            running[event.aggregate_id] = event.payload_as(OrderRepriced).total
        elif event.type == "order.line_added":
            running[event.aggregate_id] += event.payload_as(LineAdded).cents
        elif event.type == "order.paid":
            paid[event.aggregate_id] = event.payload_as(OrderPaid).total
            assert paid[event.aggregate_id] == running[event.aggregate_id]
    return paid


async def main(count: int, mode: str) -> dict[str, Any]:
    server = None
    uri = os.environ.get("MONGODB_URI")
    if not uri:
        server = start_emulator()
        uri = server.uri
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri, tz_aware=True)
    name = f"beanie{uuid.uuid4().hex[:8]}"
    try:
        db = client[name]
        await init_beanie(database=db, document_models=[Order])  # Beanie and the outbox: one db
        outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
        await outbox.ensure_indexes()
        await serve(BeanieOutbox(outbox), count)
        publisher = MemoryPublisher()
        published = await PollingRelay(outbox, publisher).drain()
        totals = rebuild(publisher.events)
        stored = {str(order.id): order.total async for order in Order.find(Order.status == "paid")}
        sequences: dict[Any, list[int]] = defaultdict(list)
        for event in publisher.events:
            sequences[event.aggregate_id].append(event.sequence or 0)
        tidy = await Order.find(Order.customer == "Customer 1").count()
        summary = {
            "mode": mode,
            "orders": count,
            "events published": published,
            "orders paid": len(stored),
            "names tidied by the action": tidy > 0,
            "totals rebuilt from events match the orders": totals == stored,
            "sequences gap-free per order": all(
                s == list(range(1, len(s) + 1)) for s in sequences.values()
            ),
        }
        await client.drop_database(name)
    finally:
        await client.close()
        if server:
            server.stop()
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=30)
    parser.add_argument("--mode", choices=["collection", "embedded"], default="collection")
    args = parser.parse_args()
    result = asyncio.run(main(args.orders, args.mode))
    ok = (
        result["totals rebuilt from events match the orders"]
        and result["sequences gap-free per order"]
    )
    sys.exit(0 if ok else 1)
