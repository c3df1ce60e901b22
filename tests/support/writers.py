"""Concurrent writers in the default (collection) mode: each save in a transaction of its own,
or inside the caller's, side by side, as a web service's requests would."""

from __future__ import annotations

import asyncio
from typing import Any

from mongo_outbox import Event, Outbox

WRITERS = 8


async def save_concurrently(
    outbox: Outbox, db: Any, saves: int, *, aggregates: int = 10, first_order: int = 0
) -> list[Event]:
    """``saves`` one-event saves by ``WRITERS`` concurrent writers over ``aggregates`` orders
    (so writers meet on the same documents); even writers let the save run its own
    transaction, odd ones save inside a ``with_transaction`` of their own, beside a write of
    their own. Every save must commit (conflicts are retried, as with_transaction does on
    MongoDB); returns the committed events."""
    committed: list[Event] = []

    async def writer(number: int) -> None:
        for n in range(number, saves, WRITERS):
            order = first_order + n % aggregates
            event = Event(type="placed", payload={"n": n})
            if number % 2 == 0:
                saved = await outbox.save_with_events(None, db.orders, {"_id": order}, [event])
            else:
                async with db.client.start_session() as session:

                    async def both(session: Any, order: int = order, event: Event = event) -> Any:
                        await db.receipts.insert_one({"order": order}, session=session)
                        return await outbox.save_with_events(
                            session, db.orders, {"_id": order}, [event]
                        )

                    saved = await session.with_transaction(both)
            committed.extend(saved.events)

    await asyncio.gather(*(writer(number) for number in range(WRITERS)))
    return committed
