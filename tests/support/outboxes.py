"""Outboxes for tests, in either mode, and what to look at in them: histories of saves, the
entries not yet published, the order a broker received an aggregate's events in."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from pymongo.errors import PyMongoError

from mongo_outbox import Event, Outbox
from mongo_outbox._codec import numbered
from mongo_outbox.events import utc_now

MODES = ["collection", "embedded"]


def make_outbox(db: Any, mode: str = "collection", **options: Any) -> Outbox:
    """An Outbox of ``mode``; embedded mode scans the ``orders`` collection."""
    return Outbox(db, mode=mode, collections=["orders"], **options)  # type: ignore[arg-type]


async def save_history(
    outbox: Outbox,
    db: Any,
    aggregates: int,
    saves: int,
    types: Sequence[str] = ("changed", "noted"),
) -> list[Event]:
    """``saves`` saves per order, one event of each of ``types`` each, interleaved across
    orders (ids 0 to ``aggregates`` - 1)."""
    events: list[Event] = []
    for step in range(saves):
        for aggregate in range(aggregates):
            saved = await outbox.save_with_events(
                None,
                db.orders,
                {"_id": aggregate, "step": step},
                [Event(type=kind, payload={"step": step}) for kind in types],
            )
            events += saved.events
    return events


async def unsettled(outbox: Outbox, db: Any) -> list[dict[str, Any]]:
    """Outbox entries not yet published (pending or parked), in either mode."""
    if outbox.mode == "collection":
        entries: list[dict[str, Any]] = await db.outbox.find(
            {"status": {"$ne": "published"}}
        ).to_list(None)
        return entries
    return [entry async for doc in db.orders.find() for entry in doc.get("_outbox") or []]


def stored_entries(document: dict[str, Any], field: str = "_outbox") -> list[dict[str, Any]]:
    """An embedded document's entries with their sequences, as the relay reads them (an entry
    an operator update appended is stored unnumbered)."""
    return numbered(document.get(field) or [], document.get("_sequence"))


async def make_due(db: Any, outbox: Outbox) -> None:
    """Skip the remaining backoff of every pending entry, as waiting it out would."""
    if outbox.mode == "collection":
        await db.outbox.update_many({"status": "pending"}, {"$set": {"available_at": utc_now()}})
    else:
        await db.orders.update_many(
            {outbox.due_field: {"$ne": None}}, {"$set": {outbox.due_field: utc_now()}}
        )


def assert_in_order(published: Sequence[Event], saved: Sequence[Event], *, once: bool) -> None:
    """Every saved event was published, nothing else was, and per aggregate the first
    publications follow sequence order. ``once``: no event was published twice (else
    republished duplicates may follow, with the same id)."""
    assert {e.id for e in published} == {e.id for e in saved}
    if once:
        assert len(published) == len(saved), "an event was published twice"
    firsts: dict[Any, list[int]] = defaultdict(list)
    seen: set[str] = set()
    for event in published:
        if event.id not in seen:
            seen.add(event.id)
            firsts[(event.aggregate_type, event.aggregate_id)].append(event.sequence or 0)
    expected: dict[Any, list[int]] = defaultdict(list)
    for event in saved:
        expected[(event.aggregate_type, event.aggregate_id)].append(event.sequence or 0)
    for aggregate, sequences in firsts.items():
        assert sequences == sorted(expected[aggregate]), f"aggregate {aggregate}: {sequences}"


async def save_aborted(outbox: Outbox, db: Any, order: int) -> str:
    """Save an event in a transaction aborted on purpose; return the id that must never appear."""
    doomed = Event(type="doomed")
    async with db.client.start_session() as session:
        while True:
            try:
                async with await session.start_transaction():
                    await outbox.save_with_events(session, db.orders, {"_id": order}, [doomed])
                    raise RuntimeError("abort on purpose")
            except RuntimeError:
                return doomed.id
            except PyMongoError as error:
                # A concurrent writer holds the order: try again, as with_transaction would.
                if not error.has_error_label("TransientTransactionError"):
                    raise


async def save_one_by_one(outbox: Outbox, db: Any, aggregates: int, events: int) -> list[Event]:
    """``events`` saves of one event each for every order (ids 0 to ``aggregates`` - 1), order
    after order, after ``ensure_indexes``."""
    await outbox.ensure_indexes()
    saved: list[Event] = []
    for order in range(aggregates):
        for _ in range(events):
            result = await outbox.save_with_events(
                None, db.orders, {"_id": order}, [Event(type="e")]
            )
            saved += result.events
    return saved
