"""The billing consumer the inbox tests run behind every broker: orders saved with one event
each, relayed twice (as after a relay crash), and a guarded handler writing one invoice per
order in the inbox's transaction."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from mongo_outbox import Backoff, Event, Inbox, Outbox, PollingRelay, inbox_guard


def concurrency(mongo: Any) -> int:
    """Messages handled at once, on every MongoDB the suite runs on (the emulator's
    transactions behave as a replica set's:
    tests/integration/testground/test_transaction_semantics.py)."""
    return 8


async def save_orders(db: Any, count: int) -> list[Event]:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    saved: list[Event] = []
    for n in range(count):
        result = await outbox.save_with_events(
            None, db.orders, {"_id": n, "total": n}, [Event(type="order.placed", payload={"n": n})]
        )
        saved += result.events
    return saved


async def relay_twice(db: Any, publisher: Any) -> None:
    """Publish every event, then all of them again, as a relay crash would."""
    outbox = Outbox(db)
    assert await PollingRelay(outbox, publisher).drain() > 0
    await asyncio.sleep(0.2)  # past a JetStream duplicate window of 0.1 s
    await db.outbox.update_many({}, {"$set": {"status": "pending", "available_at": _epoch()}})
    assert await PollingRelay(outbox, publisher).drain() > 0
    await publisher.aclose()


def _epoch() -> Any:
    from datetime import datetime, timezone

    return datetime(2000, 1, 1, tzinfo=timezone.utc)


def guarded_billing(db: Any, *, flaky: set[str] | None = None) -> Any:
    """A handler writing one invoice per order; events in ``flaky`` fail on their first try."""

    @inbox_guard(
        Inbox(db, consumer="billing", transactional=True),
        backoff=Backoff(initial=0.05, maximum=0.1),
    )
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        if flaky and event.id in flaky and attempt == 1:
            raise ConnectionError("ledger busy")
        await db.invoices.insert_one({"event": event.id}, session=session)

    return bill


async def wait_for_invoices(db: Any, count: int) -> Counter[str]:
    for _ in range(200):
        if await db.invoices.count_documents({}) >= count:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # anything extra would have arrived by now
    return Counter(d["event"] for d in await db.invoices.find().to_list(None))
