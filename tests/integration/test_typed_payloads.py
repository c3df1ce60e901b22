"""A pydantic model as payload: stored as JSON (no BSON dates or decimals), published as JSON,
validated back by the consumer with ``payload_as``."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import pytest
from pydantic import BaseModel

from mongo_outbox import Event, Outbox, PollingRelay
from mongo_outbox.publishers import MemoryPublisher

MODES = ["collection", "embedded"]


class ItemAdded(BaseModel):
    cart: uuid.UUID
    sku: str
    price: Decimal
    at: datetime


@pytest.mark.parametrize("mode", MODES)
async def test_a_model_payload_travels_as_json_and_validates_back(db: Any, mode: str) -> None:
    outbox = Outbox(db, mode=mode, collections=["carts"])  # type: ignore[arg-type]
    added = ItemAdded(
        cart=uuid.uuid4(), sku="book", price=Decimal("12.50"), at=datetime.now(timezone.utc)
    )
    await outbox.update_with_events(
        None,
        db.carts,
        {"_id": 1},
        {"$push": {"items": "book"}},
        [Event.of(added, type="cart.item_added")],
        upsert=True,
    )
    if mode == "collection":
        stored = (await db.outbox.find_one())["payload"]
    else:
        stored = (await db.carts.find_one())["_outbox"][0]["payload"]
    assert stored == {"cart": str(added.cart), "sku": "book", "price": "12.50", "at": stored["at"]}
    assert isinstance(stored["at"], str)
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1
    received = Event.from_json(publisher.events[0].model_dump_json())
    assert received.payload_as(ItemAdded) == added
