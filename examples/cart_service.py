"""A cart service that writes with update operators, each change recorded as a typed event.

    python examples/cart_service.py [--carts 40] [--mode embedded]

Carts are never loaded and saved back whole: lines go in with ``$push`` and ``$inc``, out with
``$pull``, the checkout is a guarded ``$set`` with ``expected_version``, and abandoned carts are
deleted with their event (collection mode) or marked and removed once their events are out
(embedded mode, where a document holds its own events). In collection mode a stock reservation
is written by hand in the service's own transaction, with ``add_events`` beside it. A relay then
publishes everything, and a consumer rebuilds every cart's total from the typed events alone.

MongoDB: MONGODB_URI, else the mongoeco emulator started here (mongo_outbox.testing, which needs
mongo-outbox[testing] and Python >= 3.13). Events go to an in-memory publisher: the broker side
is the other demo's (order_service.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections import defaultdict
from typing import Any

from pydantic import BaseModel
from pymongo import AsyncMongoClient

from mongo_outbox import Event, Outbox, PollingRelay
from mongo_outbox.publishers import MemoryPublisher
from mongo_outbox.testing import start_emulator

PRICES = {"book": 1200, "pen": 150, "mug": 800}


class ItemAdded(BaseModel):
    sku: str
    quantity: int
    cents: int


class ItemRemoved(BaseModel):
    sku: str
    cents: int


class CheckedOut(BaseModel):
    total_cents: int


class Carts:
    """The service's writes: one update (or delete) with its events per change."""

    def __init__(self, client: Any, outbox: Outbox) -> None:
        self.client = client
        self.outbox = outbox
        self.carts = outbox.db.carts

    async def open(self, cart: str, customer: str) -> None:
        await self.outbox.update_with_events(
            None,
            self.carts,
            {"_id": cart, "customer": customer},
            {"$set": {"status": "open", "lines": [], "total_cents": 0}},
            [Event(type="cart.opened")],
            upsert=True,
            expected_version=0,  # a new cart: it must not exist yet
        )

    async def add(self, cart: str, sku: str, quantity: int) -> None:
        added = ItemAdded(sku=sku, quantity=quantity, cents=PRICES[sku] * quantity)
        await self.outbox.update_with_events(
            None,
            self.carts,
            {"_id": cart, "status": "open"},  # only an open cart takes items
            {
                "$push": {"lines": {"sku": sku, "quantity": quantity}},
                "$inc": {"total_cents": added.cents},
            },
            [Event.of(added, type="cart.item_added")],
        )
        if self.outbox.mode == "collection":
            await self.reserve(cart, sku, quantity)

    async def reserve(self, cart: str, sku: str, quantity: int) -> None:
        """The service's own writes in its own transaction, with the event beside them."""
        async with self.client.start_session() as session:
            async with await session.start_transaction():
                await self.outbox.db.stock.update_one(
                    {"_id": sku}, {"$inc": {"reserved": quantity}}, upsert=True, session=session
                )
                await self.carts.update_one(
                    {"_id": cart}, {"$addToSet": {"reserved": sku}}, session=session
                )
                await self.outbox.add_events(
                    session, self.carts, cart, [Event(type="cart.stock_reserved")]
                )

    async def remove(self, cart: str, sku: str) -> None:
        stored = await self.carts.find_one({"_id": cart}, {"lines": 1})
        quantity = sum(line["quantity"] for line in stored["lines"] if line["sku"] == sku)
        removed = ItemRemoved(sku=sku, cents=PRICES[sku] * quantity)
        await self.outbox.update_with_events(
            None,
            self.carts,
            {"_id": cart, "status": "open"},
            {"$pull": {"lines": {"sku": sku}}, "$inc": {"total_cents": -removed.cents}},
            [Event.of(removed, type="cart.item_removed")],
        )

    async def check_out(self, cart: str) -> None:
        stored = await self.carts.find_one({"_id": cart}, {"_version": 1, "total_cents": 1})
        await self.outbox.update_with_events(
            None,
            self.carts,
            {"_id": cart, "status": "open"},
            {"$set": {"status": "checked_out"}},
            [Event.of(CheckedOut(total_cents=stored["total_cents"]), type="cart.checked_out")],
            expected_version=stored["_version"],  # nobody changed it since we read the total
        )

    async def abandon(self, cart: str) -> None:
        if self.outbox.mode == "collection":
            await self.outbox.delete_with_events(
                None, self.carts, {"_id": cart}, [Event(type="cart.abandoned")]
            )
            return
        # Embedded mode keeps the events in the document: mark it, remove it once they are out.
        await self.outbox.update_with_events(
            None,
            self.carts,
            {"_id": cart},
            {"$set": {"status": "abandoned"}},
            [Event(type="cart.abandoned")],
        )

    async def clean_up(self) -> int:
        """Embedded mode: remove abandoned carts whose events the relay has published."""
        result = await self.carts.delete_many({"status": "abandoned", "_outbox": {"$size": 0}})
        return int(result.deleted_count)


async def shop(carts: Carts, count: int) -> None:
    for n in range(count):
        cart = f"cart-{n}"
        await carts.open(cart, customer=f"c{n % 7}")
        await carts.add(cart, "book", 1 + n % 2)
        await carts.add(cart, "pen", 3)
        if n % 3 == 0:
            await carts.add(cart, "mug", 1)
            await carts.remove(cart, "pen")
        if n % 5 == 4:
            await carts.abandon(cart)
        else:
            await carts.check_out(cart)


def rebuild(events: list[Event]) -> dict[Any, int]:
    """The consumer's side: every checked-out cart's total, from the typed events alone."""
    running: dict[Any, int] = defaultdict(int)
    totals: dict[Any, int] = {}
    for event in events:
        if event.type == "cart.item_added":
            running[event.aggregate_id] += event.payload_as(ItemAdded).cents
        elif event.type == "cart.item_removed":
            running[event.aggregate_id] -= event.payload_as(ItemRemoved).cents
        elif event.type == "cart.checked_out":
            totals[event.aggregate_id] = event.payload_as(CheckedOut).total_cents
            assert totals[event.aggregate_id] == running[event.aggregate_id]
    return totals


async def main(count: int, mode: str) -> dict[str, Any]:
    server = None
    uri = os.environ.get("MONGODB_URI")
    if not uri:
        server = start_emulator()
        uri = server.uri
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    name = f"carts{uuid.uuid4().hex[:8]}"
    try:
        outbox = Outbox(client[name], mode=mode, collections=["carts"])  # type: ignore[arg-type]
        await outbox.ensure_indexes()
        carts = Carts(client, outbox)
        await shop(carts, count)
        publisher = MemoryPublisher()
        published = await PollingRelay(outbox, publisher).drain()
        removed = await carts.clean_up()
        totals = rebuild(publisher.events)
        stored = {
            doc["_id"]: doc["total_cents"]
            async for doc in carts.carts.find({"status": "checked_out"})
        }
        sequences: dict[Any, list[int]] = defaultdict(list)
        for event in publisher.events:
            sequences[event.aggregate_id].append(event.sequence or 0)
        summary = {
            "mode": mode,
            "carts": count,
            "events published": published,
            "carts checked out": len(stored),
            "abandoned carts left": await carts.carts.count_documents({"status": "abandoned"}),
            "abandoned carts removed after publishing": removed,
            "totals rebuilt from events match the carts": totals == stored,
            "sequences gap-free per cart": all(
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
    parser.add_argument("--carts", type=int, default=40)
    parser.add_argument("--mode", choices=["collection", "embedded"], default="collection")
    args = parser.parse_args()
    result = asyncio.run(main(args.carts, args.mode))
    ok = (
        result["totals rebuilt from events match the carts"]
        and result["sequences gap-free per cart"]
    )
    sys.exit(0 if ok else 1)
