"""A stop (the cancellation of the task handling a delivery) cancels the handler, never the writes
that settle what it did: wherever it lands in an attempt, the message is handled once, and the
next delivery, at once, finds the record as the attempt left it.

The stops land where the guard waits for MongoDB: while a claim is on its way, or while a write
waits for the client's only connection, which another consumer's query holds (as in a busy pool,
or a failover). Cut there, a claim was held for the rest of processing_lease; a leased claim
whose effect was done was let go, and the next delivery ran the handler again; a transaction's
commit or abort was counted as made by PyMongo but never sent, and the open transaction held the
message's record until the server's transactionLifetimeLimitSeconds (10 s on the test servers,
60 s by default), the next delivery running the handler again then."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from mongo_outbox import Backoff, Event, Inbox, Outcome, inbox_guard
from tests.support.servers import MongoServer

FAST = Backoff(initial=0.01, maximum=0.02)
MODES = [True, False]  # transactional, leased
AT_ONCE = 2.0
"""Seconds: the next delivery's answer, well below the server's transaction lifetime (10 s)."""


@pytest.fixture
async def one_connection(mongo: MongoServer, db: Any) -> AsyncIterator[Any]:
    """The test's database through a client of one connection."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(mongo.uri, tz_aware=True, maxPoolSize=1)
    yield client[db.name]
    await client.close()


def an_event() -> Event:
    return Event(type="order.paid", payload={"cents": 100}, aggregate_type="orders", aggregate_id=1)


async def holding_the_connection(db: Any) -> asyncio.Task[Any]:
    """Another consumer's query, holding the client's only connection for its round trip."""
    query = asyncio.ensure_future(db.other.find_one({}))
    await asyncio.sleep(0)  # it takes the connection
    return query


async def next_delivery(guarded: Any, event: Event) -> tuple[Outcome, int, float]:
    loop = asyncio.get_running_loop()
    began = loop.time()
    result = await asyncio.wait_for(guarded.handle(event), 30)
    return result.outcome, result.attempt, loop.time() - began


@pytest.mark.parametrize("transactional", MODES, ids=["transactional", "leased"])
async def test_a_stop_once_the_handler_returned_leaves_its_effect_done_once(
    one_connection: Any, transactional: bool
) -> None:
    # The stop lands as the handler returns, while the record waits for the connection: the
    # leased record marked done, the transaction's commit.
    db = one_connection
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    await inbox.ensure_indexes()
    returned = asyncio.Event()
    queries: list[asyncio.Task[Any]] = []
    runs: list[int] = []

    @inbox_guard(inbox, backoff=FAST)
    async def charge(event: Event, session: Any, *, attempt: int) -> None:
        await db.charges.insert_one({"event": event.id}, session=session)
        runs.append(attempt)
        queries.append(await holding_the_connection(db))
        returned.set()

    event = an_event()
    attempt = asyncio.create_task(charge.handle(event))
    await returned.wait()
    attempt.cancel()  # the consumer stops
    with pytest.raises(asyncio.CancelledError):
        await attempt
    await asyncio.gather(*queries)
    # The consumer gave the message back: the next delivery finds it handled, at once.
    outcome, number, took = await next_delivery(charge, event)
    assert (outcome, number) == (Outcome.DUPLICATE, 1)
    assert took < AT_ONCE
    assert runs == [1]
    assert await db.charges.count_documents({}) == 1


@pytest.mark.parametrize("transactional", MODES, ids=["transactional", "leased"])
async def test_a_second_stop_does_not_cut_the_giving_back_of_the_message(
    one_connection: Any, transactional: bool
) -> None:
    # The first stop cancels the hanging handler; the second lands while its transaction is
    # aborted, or its claim let go, waiting for the connection.
    db = one_connection
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    await inbox.ensure_indexes()
    hangs, cancelled = asyncio.Event(), asyncio.Event()
    queries: list[asyncio.Task[Any]] = []
    runs: list[int] = []

    @inbox_guard(inbox, backoff=FAST)
    async def charge(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(attempt)
        if len(runs) == 1:
            try:
                hangs.set()
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                queries.append(await asyncio.shield(holding_the_connection(db)))
                cancelled.set()
                raise
        await db.charges.insert_one({"event": event.id}, session=session)

    event = an_event()
    attempt = asyncio.create_task(charge.handle(event))
    await hangs.wait()
    attempt.cancel()
    await cancelled.wait()
    attempt.cancel()  # a supervisor's second cancellation
    with pytest.raises(asyncio.CancelledError):
        await attempt
    await asyncio.gather(*queries)
    outcome, number, took = await next_delivery(charge, event)
    assert (outcome, number) == (Outcome.HANDLED, 1)  # at once, as the first attempt
    assert took < AT_ONCE
    assert await db.charges.count_documents({}) == 1


async def test_a_stop_that_lands_while_the_message_is_claimed_does_not_hold_it(db: Any) -> None:
    # Leased: the claim is on its way when the stop lands. It is made; the handler does not
    # start, and the claim is let go, not held for the rest of processing_lease (60 s).
    inbox = Inbox(db, consumer="billing", transactional=False)
    await inbox.ensure_indexes()
    runs: list[int] = []

    @inbox_guard(inbox, backoff=FAST)
    async def charge(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(attempt)

    await charge.handle(an_event())  # a first message: the inbox is ready, its handler known
    event = an_event()
    attempt = asyncio.create_task(charge.handle(event))
    await asyncio.sleep(0)  # it sends the claim, and waits for the reply
    attempt.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attempt
    outcome, number, took = await next_delivery(charge, event)
    assert (outcome, number) == (Outcome.HANDLED, 1)
    assert took < AT_ONCE
    assert runs == [1, 1]  # the first message's, then this one's: once
