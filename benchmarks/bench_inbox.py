"""Messages/s through an inbox_guard-ed handler against the same handler unguarded, and the
database commands each message costs, in both inbox modes.

The handler writes one invoice. Unguarded, in transactional mode, it runs in a transaction of
its own (``with_transaction``): the difference is what the inbox adds. "By hand" writes the same
inbox record into the same indexed collection without the library, which separates the library's
own cost from the database's (the emulator's unique index alone makes inserts several times
slower). Messages are handled one after another: the emulator cannot run transactions side by
side faithfully.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.common import (
    CommandCounter,
    client,
    fresh_db,
    header,
    median,
    say,
    standalone,
    timed,
)
from mongo_outbox import Event, Inbox, inbox_guard

MESSAGES = 150
REPEATS = 3

Handle = Callable[[Event], Awaitable[Any]]


def events() -> list[Event]:
    return [
        Event(type="order.placed", aggregate_type="orders", aggregate_id=n, payload={"n": n})
        for n in range(MESSAGES)
    ]


async def guarded(db: Any, transactional: bool) -> Handle:
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    await inbox.ensure_indexes()  # once, outside the measurement
    await inbox.uses_transactions()

    @inbox_guard(inbox)
    async def bill(event: Event, session: Any) -> None:
        await db.invoices.insert_one({"order": event.aggregate_id}, session=session)

    return bill


async def unguarded(db: Any, transactional: bool) -> Handle:
    await db.invoices.insert_one({"warm": True})
    await db.invoices.delete_many({})

    async def bill(event: Event) -> None:
        if not transactional:
            await db.invoices.insert_one({"order": event.aggregate_id})
            return

        async def write(session: Any) -> None:
            await db.invoices.insert_one({"order": event.aggregate_id}, session=session)

        async with db.client.start_session() as session:
            await session.with_transaction(write)

    return bill


async def by_hand(db: Any, transactional: bool) -> Handle:
    """The inbox written by hand: the same indexes, a plain insert of the record."""
    await Inbox(db, consumer="billing").ensure_indexes()

    async def bill(event: Event) -> None:
        record = {"consumer": "billing", "source": "orders", "message_id": event.id}
        if not transactional:
            await db.inbox.insert_one(record | {"status": "processing"})
            await db.invoices.insert_one({"order": event.aggregate_id})
            await db.inbox.update_one(record, {"$set": {"status": "done"}})
            return

        async def write(session: Any) -> None:
            await db.inbox.insert_one(record | {"status": "done"}, session=session)
            await db.invoices.insert_one({"order": event.aggregate_id}, session=session)

        async with db.client.start_session() as session:
            await session.with_transaction(write)

    return bill


async def measure(uri: str, transactional: bool) -> list[str]:
    counter = CommandCounter()
    mongo = client(uri, counter)
    mode = "transactional" if transactional else "leased"
    rates: dict[str, list[float]] = {"guarded": [], "unguarded": [], "by hand": []}
    commands: dict[str, CommandCounter] = {}
    try:
        for _ in range(REPEATS):
            for name, make in (
                ("unguarded", unguarded),
                ("by hand", by_hand),
                ("guarded", guarded),
            ):
                async with fresh_db(mongo) as db:
                    handle = await make(db, transactional)
                    batch = events()
                    counter.reset()

                    async def work(handle: Handle = handle, batch: list[Event] = batch) -> None:
                        for event in batch:
                            await handle(event)

                    rates[name].append(MESSAGES / await timed(work))
                    snapshot = CommandCounter()
                    snapshot.counts = counter.counts.copy()
                    commands[name] = snapshot
    finally:
        await mongo.close()
    lines = []
    for name in ("unguarded", "by hand", "guarded"):
        per_message = commands[name].total / MESSAGES
        lines.append(
            f"{mode:<13} {name:<9} {median(rates[name]):7.0f} msg/s  "
            f"{per_message:.2f} commands/message ({commands[name].breakdown()})"
        )
    added = (commands["guarded"].total - commands["unguarded"].total) / MESSAGES
    guarded_rate = median(rates["guarded"])
    lines.append(
        f"{mode:<13} ratio guarded/unguarded {guarded_rate / median(rates['unguarded']):.2f}, "
        f"guarded/by hand {guarded_rate / median(rates['by hand']):.2f}; "
        f"the inbox adds {added:.2f} commands per message"
    )
    for line in lines:
        say(line)
    return lines


async def run(uri: str) -> list[str]:
    header(f"inbox_guard: {MESSAGES} messages handled one after another, median of {REPEATS}")
    return [line for transactional in (True, False) for line in await measure(uri, transactional)]


if __name__ == "__main__":
    standalone(run)
