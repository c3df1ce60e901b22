"""The write side's step generators with scripted replies, no database: which calls a write makes
in which order, and what it concludes from the replies (``_write/refusals.py``,
``_write/documents.py``), and the two drivers that perform the calls for the async and sync APIs
(``_steps.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError, OperationFailure

from mongo_outbox import Event
from mongo_outbox._steps import Steps, call, listing, run_async, run_sync
from mongo_outbox._write.documents import DocumentWriter, bump
from mongo_outbox._write.plan import Plan
from mongo_outbox._write.refusals import explain
from mongo_outbox._write.rules import Rules
from mongo_outbox.errors import (
    AggregateNotFoundError,
    ConcurrencyError,
    DuplicateEventError,
    InvalidAggregateError,
    InvalidCountersError,
)
from tests.support.layouts import layout
from tests.support.scripted import ANY, Turn, play

OWNED = frozenset({"_version", "_sequence"})
COUNTERS = {"_version": 1, "_sequence": 1, "_due": 1}


def rules(db: Any, mode: str = "collection") -> Rules:
    return Rules(db, layout(db, mode), {}, OWNED)


def an_update(db: Any, *, expected_version: int | None = None, upsert: bool = False) -> Plan:
    return rules(db).update(
        None,
        db.orders,
        {"_id": 7, "status": "open"},
        {"$set": {"status": "paid"}},
        [Event(type="paid")],
        upsert,
        expected_version,
    )


def find(query: dict[str, Any], reply: Any = None, due: str = "_due") -> Turn:
    """The read ``explain`` makes: the counters (and ``due`` time) of the document ``query``
    matches."""
    projection = {"_version": 1, "_sequence": 1, due: 1}
    return Turn("find_one", (query, projection), {"session": None}, reply, target="orders")


def test_an_update_whose_document_moved_on_is_a_conflict_at_the_version_it_expected(
    shop: Any,
) -> None:
    plan = an_update(shop, expected_version=3)
    with pytest.raises(ConcurrencyError, match="not at version 3") as raised:
        play(explain(plan, None, None, "_due"), find({"_id": 7}, {"_id": 7, "_version": 4}))
    assert raised.value.expected_version == 3


def test_an_update_whose_guards_fail_says_the_document_exists_but_not_the_filter(
    shop: Any,
) -> None:
    plan = an_update(shop)
    steps = explain(plan, None, None, "_due")
    with pytest.raises(AggregateNotFoundError, match="exists, but not the rest of the filter"):
        play(steps, find({"_id": 7}, {"_id": 7, "_version": 1}), find(plan.query, None))


def test_an_update_of_no_document_says_no_document_has_that_id(shop: Any) -> None:
    plan = an_update(shop)
    with pytest.raises(AggregateNotFoundError, match="no document has that _id"):
        play(explain(plan, None, None, "_due"), find({"_id": 7}, None))


def test_an_upsert_whose_document_vanished_may_be_tried_again(shop: Any) -> None:
    plan = an_update(shop, upsert=True)
    assert play(explain(plan, None, None, "_due"), find({"_id": 7}, None)) is None


def test_a_matching_document_at_its_version_means_a_concurrent_write_got_in_first(
    shop: Any,
) -> None:
    plan = an_update(shop, expected_version=2)
    doc = {"_id": 7, "_version": 2}
    assert (
        play(explain(plan, None, None, "_due"), find({"_id": 7}, doc), find(plan.query, doc))
        is None
    )


def test_an_embedded_write_repeated_after_it_succeeded_is_a_duplicate_event(shop: Any) -> None:
    plan = an_update(shop)
    ids = {"$in": [plan.events[0].id]}
    holder = {"_id": 7, "$or": [{"_outbox.id": ids}, {"_outbox_sent": ids}]}
    with pytest.raises(DuplicateEventError, match="already holds an event of these ids"):
        play(explain(plan, None, "_outbox", "_due"), find(holder, {"_id": 7}))


def test_a_read_refused_in_an_aborted_transaction_is_made_again_outside_it(shop: Any) -> None:
    plan = an_update(shop, expected_version=3)
    aborted = OperationFailure("Transaction has been aborted", code=251)
    with pytest.raises(ConcurrencyError):
        play(
            explain(plan, None, None, "_due"),
            Turn("find_one", ({"_id": 7}, COUNTERS), {"session": None}, raises=aborted),
            Turn("find_one", ({"_id": 7}, COUNTERS), {}, {"_version": 5}),
        )


def adding(shop: Any, events: int) -> Plan:
    """add_events' plan: ``events`` events beside the caller's own write of order 7."""

    class InTransaction:  # FAKE session: add_events checks only that one is open
        client = shop.client
        in_transaction = True
        has_ended = False

    return rules(shop).add(
        InTransaction(), shop.orders, 7, [Event(type="x") for _ in range(events)]
    )


def bumped(plan: Plan, reply: Any) -> Turn:
    return Turn(
        "find_one_and_update",
        ({"_id": 7}, {"$inc": {"_version": 1, "_sequence": len(plan.events)}}),
        {
            "projection": {"_version": 1, "_sequence": 1},
            "return_document": ReturnDocument.AFTER,
            "session": None,
        },
        reply,
    )


def test_add_events_moves_both_counters_in_one_call_and_numbers_from_the_stored_sequence(
    shop: Any,
) -> None:
    plan = adding(shop, 2)
    assert play(bump(plan, None), bumped(plan, {"_version": 3, "_sequence": 9})) == (3, 9, True)


def test_add_events_to_a_document_that_is_not_there_is_not_found(shop: Any) -> None:
    plan = adding(shop, 1)
    with pytest.raises(AggregateNotFoundError, match="no document has that _id"):
        play(bump(plan, None), bumped(plan, None))


@pytest.mark.parametrize(
    "stored", [{"_version": "3", "_sequence": 1}, {"_version": 1, "_sequence": -5}]
)
def test_add_events_refuses_counters_that_are_no_whole_numbers_in_range(
    shop: Any, stored: dict[str, Any]
) -> None:
    plan = adding(shop, 1)
    with pytest.raises(InvalidCountersError, match="must not commit"):
        play(bump(plan, None), bumped(plan, stored))


# The drivers: the async and the sync API perform the same steps the same way.


class Recorder:
    """FAKE collection: answers ``find`` with a cursor of its rows, ``fail`` with an error, and
    ``read`` with a value, awaitable or not; records the calls."""

    def __init__(self, awaitable: bool) -> None:
        self.awaitable = awaitable
        self.calls: list[str] = []

    def read(self, value: int) -> Any:
        self.calls.append("read")
        return self._answer(value)

    def fail(self) -> Any:
        self.calls.append("fail")
        raise OperationFailure("refused", code=11000)

    def find(self) -> Any:
        self.calls.append("find")
        rows = [1, 2, 3]
        if not self.awaitable:
            return iter(rows)

        class Cursor:
            async def to_list(self, length: int | None) -> list[int]:
                return rows

        return Cursor()

    def _answer(self, value: int) -> Any:
        if not self.awaitable:
            return value

        async def later() -> int:
            return value

        return later()


def a_write(target: Recorder, log: list[str]) -> Steps[tuple[int, list[int], str]]:
    try:
        value = yield call(target, "read", 41)
        rows = yield listing(target, "find")
        try:
            yield call(target, "fail")
            caught = "nothing"
        except OperationFailure as error:
            caught = f"code {error.code}"
        return value + 1, rows, caught
    finally:
        log.append("cleaned up")


async def test_both_drivers_give_the_steps_each_reply_the_whole_cursor_and_each_error() -> None:
    expected = (42, [1, 2, 3], "code 11000")
    sync, log = Recorder(awaitable=False), []
    assert run_sync(a_write(sync, log)) == expected
    asynchronous = Recorder(awaitable=True)
    assert await run_async(a_write(asynchronous, log)) == expected
    assert sync.calls == asynchronous.calls == ["read", "find", "fail"]
    assert log == ["cleaned up", "cleaned up"]


async def test_a_cancelled_async_write_cleans_up_at_once_not_when_the_generator_is_collected() -> (
    None
):
    log: list[str] = []
    started = asyncio.Event()

    class Hangs:
        async def wait(self) -> None:
            started.set()
            await asyncio.Event().wait()

    def steps() -> Iterator[Any]:
        try:
            yield call(Hangs(), "wait")
        finally:
            log.append("cleaned up")

    task = asyncio.create_task(run_async(steps()))  # type: ignore[arg-type]
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["cleaned up"]


# The document writer (``_write/documents.py``): the calls of one write, and what a refusal means.


def writer(db: Any) -> DocumentWriter:
    return DocumentWriter(layout(db))


NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_creating_an_aggregate_is_one_plain_insert_with_its_counters(shop: Any) -> None:
    events = [Event(type="placed"), Event(type="paid")]
    plan = rules(shop).save(None, shop.orders, {"_id": 7, "total": 3}, events, 0)
    inserted = {"_id": 7, "total": 3, "_version": 1, "_sequence": 2}
    turn = Turn("insert_one", (inserted,), {"session": None}, target="orders")
    assert play(writer(shop).write(plan, None, NOW), turn) == (1, 2, False)


def test_creating_an_aggregate_that_exists_is_a_conflict_but_another_unique_key_is_not(
    shop: Any,
) -> None:
    plan = rules(shop).save(None, shop.orders, {"_id": 7}, [], 0)
    inserted = {"_id": 7, "_version": 1, "_sequence": 0}
    on_id = DuplicateKeyError("E11000", 11000, {"keyPattern": {"_id": 1}})
    with pytest.raises(ConcurrencyError, match="it exists already"):
        play(
            writer(shop).write(plan, None, NOW),
            Turn("insert_one", (inserted,), {"session": None}, raises=on_id),
        )
    on_email = DuplicateKeyError("E11000", 11000, {"keyPattern": {"email": 1}})
    with pytest.raises(DuplicateKeyError):
        play(
            writer(shop).write(plan, None, NOW),
            Turn("insert_one", (inserted,), {"session": None}, raises=on_email),
        )


def deleting(shop: Any, expected_version: int | None) -> tuple[Plan, Turn]:
    plan = rules(shop).delete(None, shop.orders, {"_id": 7}, [Event(type="gone")], expected_version)
    query = {"_id": 7, "_version": expected_version} if expected_version else {"_id": 7}
    delete = Turn(
        "find_one_and_delete",
        (query,),
        {"projection": {"_version": 1, "_sequence": 1}, "session": None},
        None,
    )
    return plan, delete


def test_a_delete_returns_the_counters_moved_past_the_document_it_removed(shop: Any) -> None:
    plan, delete = deleting(shop, 4)
    removed = dataclasses.replace(delete, reply={"_version": 4, "_sequence": 6})
    assert play(writer(shop).write(plan, None, NOW), removed) == (5, 7, True)


def test_a_delete_overtaken_by_concurrent_writes_gives_up_after_three_attempts(shop: Any) -> None:
    plan, delete = deleting(shop, None)
    there = {"_id": 7, "_version": 2}
    # Each attempt matches nothing, and the reads find the document matching: overtaken.
    attempt = (
        delete,
        find({"_id": 7}, there, "_outbox_due"),
        find({"_id": 7}, there, "_outbox_due"),
    )
    with pytest.raises(ConcurrencyError) as raised:
        play(writer(shop).write(plan, None, NOW), *attempt, *attempt, *attempt)
    # No version was expected: it said "not at version None", expected_version 0 ("must not
    # exist").
    assert "changed under this write at each of its tries" in str(raised.value)
    assert raised.value.expected_version is None


def test_an_update_the_server_refuses_for_its_content_is_invalid_but_a_transient_error_is_not(
    shop: Any,
) -> None:
    plan = an_update(shop)
    refused = OperationFailure("Cannot apply $inc to a string", code=14)
    with pytest.raises(InvalidAggregateError, match=r"MongoDB refused the update .* \(code 14\)"):
        play(writer(shop).write(plan, None, NOW), Turn(ANY, raises=refused))
    transient = OperationFailure(
        "conflict", code=14, details={"errorLabels": ["TransientTransactionError"]}
    )
    with pytest.raises(OperationFailure) as raised:
        play(writer(shop).write(plan, None, NOW), Turn(ANY, raises=transient))
    assert raised.value is transient
