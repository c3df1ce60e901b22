"""inbox_guard against the session's MongoDB: once-only effects, storms, retries, poison, leases."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from mongo_outbox import (
    Backoff,
    DeadLettered,
    Event,
    Inbox,
    MessageIdentityError,
    Outcome,
    PoisonMessage,
    RetryLater,
    inbox_guard,
)
from tests.support.servers import MongoServer

FAST = Backoff(initial=0.01, maximum=0.02)
MODES = [True, False]  # transactional, leased
LEASE = timedelta(seconds=0.5)


def order_event(n: int = 1) -> Event:
    return Event(type="order.placed", payload={"total": n}, aggregate_type="orders", aggregate_id=n)


@pytest.mark.parametrize("transactional", MODES)
async def test_handles_once_then_skips(db: Any, transactional: bool) -> None:
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    await inbox.ensure_indexes()
    calls: list[str] = []

    @inbox_guard(inbox)
    async def on_order_placed(event: Event, session: Any) -> None:
        calls.append(event.id)
        await db.invoices.insert_one({"order": event.aggregate_id}, session=session)

    event = order_event()
    assert await on_order_placed(event) is True
    assert await on_order_placed(event) is False
    assert await on_order_placed(event.model_copy()) is False
    assert calls == [event.id]
    assert await db.invoices.count_documents({}) == 1
    [record] = await db.inbox.find().to_list(None)
    assert (record["consumer"], record["source"], record["message_id"]) == (
        "billing",
        "orders",
        event.id,
    )
    assert record["status"] == "done" and record["attempts"] == 1
    assert record["expire_at"] - record["processed_at"] == inbox.retention
    info = await db.inbox.index_information()
    assert info["identity"]["unique"] is True
    assert info["ttl"]["expireAfterSeconds"] == 0


async def test_identity_is_per_consumer_and_source(db: Any) -> None:
    seen: Counter[str] = Counter()

    def guard(consumer: str) -> Any:
        @inbox_guard(Inbox(db, consumer=consumer, transactional=True))
        async def handler(event: Event, session: Any) -> None:
            seen[consumer] += 1

        return handler

    billing, shipping = guard("billing"), guard("shipping")
    event = order_event()
    assert await billing(event) and await shipping(event)
    assert await billing(event, source="another-service")  # same id from elsewhere: a new message
    assert not await billing(event, message_id=event.id, source="orders")
    assert seen == {"billing": 2, "shipping": 1}
    with pytest.raises(MessageIdentityError):
        await billing(event, message_id="")


@pytest.mark.parametrize("transactional", MODES)
async def test_duplicate_storm_runs_the_handler_once(db: Any, transactional: bool) -> None:
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    runs: list[str] = []

    @inbox_guard(inbox)
    async def handler(event: Event, session: Any) -> None:
        runs.append(event.id)
        await asyncio.sleep(0.01)  # let the other deliveries pile up behind this one
        await db.effects.insert_one({"event": event.id}, session=session)

    event = order_event()

    async def consumer_task() -> list[bool]:
        handled = []
        for _ in range(5):
            while True:
                try:
                    handled.append(await handler(event))
                    break
                except RetryLater as later:  # the broker would redeliver it after the delay
                    await asyncio.sleep(later.delay)
        return handled

    results = await asyncio.gather(*(consumer_task() for _ in range(6)))
    assert sum(r for task in results for r in task) == 1  # True exactly once in 30 deliveries
    assert runs == [event.id]
    assert [d["event"] for d in await db.effects.find().to_list(None)] == [event.id]


@pytest.mark.parametrize("transactional", MODES)
async def test_duplicate_storm_across_consumers_commits_the_effect_once(
    mongo: MongoServer, db: Any, transactional: bool
) -> None:
    """Consumers with clients of their own, as separate processes would be: nothing in-process
    orders them, only the inbox's unique index and, with transactions, the server's conflicts.
    A conflict is not a failed attempt: with max_attempts=1 it would otherwise dead-letter a
    message whose effect another consumer committed."""
    clients = [AsyncMongoClient[Any](mongo.uri, tz_aware=True) for _ in range(4)]
    event = order_event()
    runs: list[int] = []
    dead: list[str] = []

    async def dead_letter(event: Event, reason: str) -> None:
        dead.append(reason)

    def consumer(n: int) -> Any:
        mine = clients[n][db.name]

        @inbox_guard(
            # A short lease: a duplicate in leased mode comes back when the claim's lease ends.
            Inbox(mine, consumer="billing", transactional=transactional, processing_lease=LEASE),
            max_attempts=1,
            backoff=FAST,
            dead_letter=dead_letter,
        )
        async def handler(event: Event, session: Any) -> None:
            runs.append(n)
            await asyncio.sleep(0.02)  # overlap with the other consumers' deliveries
            await mine.effects.insert_one({"event": event.id}, session=session)

        return handler

    async def deliver(handler: Any) -> list[Outcome]:
        outcomes = []
        for _ in range(4):
            for _ in range(100):
                result = await handler.handle(event)
                if result.outcome is not Outcome.RETRY:
                    break
                await asyncio.sleep(result.delay)  # as the broker would redeliver it
            outcomes.append(result.outcome)
        return outcomes

    await Inbox(db, consumer="billing").ensure_indexes()
    try:
        results = await asyncio.gather(*(deliver(consumer(n)) for n in range(len(clients))))
    finally:
        for client in clients:
            await client.close()
    outcomes = Counter(o for task in results for o in task)
    assert outcomes == {Outcome.HANDLED: 1, Outcome.DUPLICATE: 15}
    assert dead == []
    assert [d["event"] for d in await db.effects.find().to_list(None)] == [event.id]
    [record] = await db.inbox.find().to_list(None)
    assert record["status"] == "done" and record["attempts"] == 1
    if not transactional:
        assert len(runs) == 1  # the claim keeps the others out; transactions roll theirs back


async def test_handler_duplicate_key_is_a_failure_not_a_race(db: Any) -> None:
    """Only the inbox record's duplicate key means two deliveries raced; the handler's own
    is a failure like any other, counted and finally dead-lettered, not retried forever."""
    await db.invoices.insert_one({"_id": "inv-1"})
    dead: list[str] = []

    async def dead_letter(event: Event, reason: str) -> None:
        dead.append(reason)

    @inbox_guard(
        Inbox(db, consumer="billing", transactional=True),
        max_attempts=2,
        backoff=FAST,
        dead_letter=dead_letter,
    )
    async def handler(event: Event, session: Any) -> None:
        await db.invoices.insert_one({"_id": "inv-1"}, session=session)

    event = order_event()
    first = await handler.handle(event)
    assert (first.outcome, first.attempt) == (Outcome.RETRY, 1)
    assert "DuplicateKeyError" in (first.error or "")
    second = await handler.handle(event)
    assert (second.outcome, second.attempt) == (Outcome.DEAD_LETTERED, 2)
    assert len(dead) == 1 and "gave up after 2" in dead[0]


@pytest.mark.parametrize("transactional", MODES)
async def test_transient_failures_retry_with_growing_attempts(db: Any, transactional: bool) -> None:
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    attempts_seen: list[int] = []

    @inbox_guard(inbox, backoff=Backoff(initial=1, maximum=4))
    async def flaky(event: Event, session: Any, *, attempt: int) -> None:
        attempts_seen.append(attempt)
        await db.effects.insert_one({"attempt": attempt}, session=session)
        if attempt < 3:
            raise ConnectionError("payment gateway timed out")

    event = order_event()
    for attempt in (1, 2):
        with pytest.raises(RetryLater) as caught:
            await flaky(event)
        assert caught.value.attempt == attempt
        assert 0 <= caught.value.delay <= 2 ** (attempt - 1)
        record = await db.inbox.find_one({"message_id": event.id})
        assert record["status"] == "retrying" and "timed out" in record["last_error"]
    assert await flaky(event) is True
    assert attempts_seen == [1, 2, 3]
    record = await db.inbox.find_one({"message_id": event.id})
    assert record["status"] == "done" and record["attempts"] == 3
    written = [d["attempt"] for d in await db.effects.find().to_list(None)]
    # Transactions roll back the failed attempts' writes; without them, they stay.
    assert written == ([3] if transactional else [1, 2, 3])


@pytest.mark.parametrize("transactional", MODES)
async def test_poison_is_dead_lettered_once_and_never_retried(db: Any, transactional: bool) -> None:
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    dead: list[tuple[str, str]] = []

    async def dead_letter(event: Event, reason: str) -> None:
        dead.append((event.id, reason))

    @inbox_guard(inbox, max_attempts=2, backoff=FAST, dead_letter=dead_letter)
    async def handler(event: Event, session: Any) -> None:
        if event.payload["total"] == 1:
            raise PoisonMessage("total 1 is not a price")
        raise ValueError("always broken")

    poison, broken = order_event(1), order_event(2)
    result = await handler.handle(poison)
    assert (result.outcome, result.attempt) == (Outcome.DEAD_LETTERED, 1)
    with pytest.raises(RetryLater):
        await handler(broken)
    with pytest.raises(DeadLettered) as caught:
        await handler(broken)
    assert caught.value.attempt == 2
    assert await handler(poison) is False and await handler(broken) is False
    assert [d[0] for d in dead] == [poison.id, broken.id]
    assert "not a price" in dead[0][1] and "gave up after 2" in dead[1][1]
    failed = {r["message_id"]: r for r in await inbox.failed()}
    assert set(failed) == {poison.id, broken.id}
    assert failed[broken.id]["event"]["payload"] == {"total": 2}


async def test_a_failing_dead_letter_means_retry_not_loss(db: Any) -> None:
    async def unreachable(event: Event, reason: str) -> None:
        raise ConnectionError("DLQ down")

    @inbox_guard(Inbox(db, consumer="c", transactional=True), dead_letter=unreachable, backoff=FAST)
    async def handler(event: Event, session: Any) -> None:
        raise PoisonMessage("bad")

    result = await handler.handle(order_event())
    assert result.outcome is Outcome.RETRY and "DLQ down" in (result.error or "")
    assert await db.inbox.count_documents({"status": "failed"}) == 0


@pytest.mark.parametrize("transactional", [*MODES, None])
async def test_unreachable_inbox_means_retry_not_a_crash_or_a_dead_letter(
    transactional: bool | None,
) -> None:
    # MongoDB down, as far as the consumer can tell. A name that never resolves (RFC 6761) rather
    # than a closed port: pymongo 4.18 leaks the socket of a connect that client.close() cancels,
    # and no socket is opened for a name that does not resolve.
    client = AsyncMongoClient[Any]("mongodb://mongo.invalid/?serverSelectionTimeoutMS=200")
    runs: list[str] = []
    dead: list[str] = []

    async def dead_letter(event: Event, reason: str) -> None:
        dead.append(reason)

    @inbox_guard(
        Inbox(client.down, consumer="billing", transactional=transactional),
        max_attempts=1,
        dead_letter=dead_letter,
    )
    async def handler(event: Event, session: Any) -> None:
        runs.append(event.id)

    try:
        result = await handler.handle(order_event())
    finally:
        await client.close()
    assert (result.outcome, result.attempt) == (Outcome.RETRY, 0)
    assert "inbox unavailable" in (result.error or "")
    assert runs == [] and dead == []


async def test_leased_claim_of_a_crashed_handler_is_retried_after_the_lease(db: Any) -> None:
    def mailer() -> Inbox:
        return Inbox(db, consumer="mailer", transactional=False, processing_lease=0.5)

    attempts: list[int] = []
    started = asyncio.Event()

    async def send_mail(event: Event, session: Any, *, attempt: int) -> None:
        attempts.append(attempt)
        if attempt == 1:
            started.set()
            await asyncio.Event().wait()  # until the process dies inside the handler

    # Two processes: the first never comes back from its handler (a crash: nothing after it
    # runs, where a cancellation is a stop that lets the claim go).
    crashed, alive = inbox_guard(mailer())(send_mail), inbox_guard(mailer())(send_mail)
    event = order_event()
    dying = asyncio.create_task(crashed(event))
    await started.wait()
    # The ghost: a record in "processing" that nobody will finish.
    assert (await db.inbox.find_one({"message_id": event.id}))["status"] == "processing"
    with pytest.raises(RetryLater) as caught:  # a redelivery while the lease holds waits
        await alive(event)
    assert 0 < caught.value.delay <= 0.5
    await asyncio.sleep(caught.value.delay + 0.05)
    assert await alive(event) is True
    assert attempts == [1, 2]
    assert (await db.inbox.find_one({"message_id": event.id}))["status"] == "done"
    dying.cancel()  # its claim was taken over: letting it go now changes nothing
    with pytest.raises(asyncio.CancelledError):
        await dying
    assert (await db.inbox.find_one({"message_id": event.id}))["status"] == "done"


async def test_records_expire_through_the_ttl_index(db: Any) -> None:
    inbox = Inbox(db, consumer="c", transactional=True, retention=timedelta(seconds=1))
    await inbox.ensure_indexes()

    @inbox_guard(inbox)
    async def handler(event: Event, session: Any) -> None:
        pass

    assert await handler(order_event())
    [record] = await db.inbox.find().to_list(None)  # kept until its expiry, not before
    assert record["expire_at"] - record["processed_at"] == timedelta(seconds=1)
    # A real server's TTL monitor runs every 60 s; the emulator (measured) purges within about
    # 0.3 s of the expiry. The collection's own count, not a query that could merely hide
    # expired records, shows the record is gone.
    for _ in range(150):
        if await db.inbox.estimated_document_count() == 0:
            break
        await asyncio.sleep(0.5)
    assert await db.inbox.estimated_document_count() == 0


async def test_transactional_mode_is_detected_from_the_server(db: Any, mongo: Any) -> None:
    inbox = Inbox(db, consumer="c")
    hello = await db.client.admin.command("hello")
    expected = "setName" in hello or hello.get("msg") == "isdbgrid"
    assert await inbox.uses_transactions() is expected
    assert expected  # a replica set, or the emulator's hello of one


async def test_a_storm_of_a_hundred_concurrent_transactional_deliveries_has_each_effect_once(
    mongo: MongoServer, db: Any
) -> None:
    """Twenty messages, each delivered five times, all hundred deliveries at once, through four
    clients (as four consumer processes): the inbox's unique identity and the server's write
    conflicts leave exactly one committed effect per message."""
    clients = [AsyncMongoClient[Any](mongo.uri, tz_aware=True) for _ in range(4)]
    events = [order_event(n) for n in range(20)]
    dead: list[str] = []

    async def dead_letter(event: Event, reason: str) -> None:
        dead.append(reason)

    def consumer(client: AsyncMongoClient[Any]) -> Any:
        mine = client[db.name]

        @inbox_guard(
            Inbox(mine, consumer="billing", transactional=True),
            max_attempts=1,
            backoff=FAST,
            dead_letter=dead_letter,
        )
        async def handler(event: Event, session: Any) -> None:
            await asyncio.sleep(0)  # let the other deliveries of the message overlap
            await mine.effects.insert_one({"event": event.id}, session=session)

        return handler

    handlers = [consumer(client) for client in clients]

    async def deliver(n: int) -> Outcome:
        handler, event = handlers[n % len(handlers)], events[n % len(events)]
        for _ in range(200):
            result = await handler.handle(event)
            if result.outcome is not Outcome.RETRY:
                return result.outcome
            await asyncio.sleep(result.delay)  # as the broker would redeliver it
        raise AssertionError(f"delivery {n} was still being retried")

    await Inbox(db, consumer="billing").ensure_indexes()
    try:
        outcomes = Counter(await asyncio.gather(*(deliver(n) for n in range(100))))
    finally:
        for client in clients:
            await client.close()
    assert outcomes == {Outcome.HANDLED: 20, Outcome.DUPLICATE: 80}
    assert dead == []
    effects = Counter(d["event"] for d in await db.effects.find().to_list(None))
    assert effects == Counter({event.id: 1 for event in events})
    assert await db.inbox.count_documents({"status": "done", "attempts": 1}) == 20


class Escaped(BaseException):
    """A BaseException that is no stop of the process (a library's own, say)."""


@pytest.mark.parametrize("transactional", MODES)
@pytest.mark.parametrize(
    "raised",
    [
        pytest.param(
            asyncio.CancelledError,
            id="cancelled",
            marks=pytest.mark.skipif(
                sys.version_info < (3, 11),
                reason="before 3.11 a task cannot tell a cancellation from its code's own "
                "CancelledError: taken as a stop, as before",
            ),
        ),
        pytest.param(Escaped, id="base"),
    ],
)
async def test_a_handler_s_own_base_exception_is_a_counted_failure(
    db: Any, transactional: bool, raised: type[BaseException]
) -> None:
    # Let through, it rolled the transaction back with the attempt's record: never counted,
    # the message came back at once, for ever (1,732 runs in 3 s on RabbitMQ), or was dropped
    # at NATS's max_deliver with no dead letter.
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    runs: list[int] = []

    @inbox_guard(inbox, max_attempts=2, backoff=FAST)
    async def handler(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(attempt)
        raise raised("the handler's own")

    event = order_event()
    first = await handler.handle(event)
    assert first.outcome is Outcome.RETRY and raised.__name__ in (first.error or "")
    second = await handler.handle(event)
    assert (second.outcome, second.attempt) == (Outcome.DEAD_LETTERED, 2)
    assert runs == [1, 2]
    [record] = await inbox.failed()
    assert record["attempts"] == 2


@pytest.mark.parametrize("transactional", MODES)
async def test_a_handler_cancelled_by_a_stop_spends_no_attempt(
    db: Any, transactional: bool
) -> None:
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    started = asyncio.Event()
    attempts: list[int] = []

    @inbox_guard(inbox, backoff=FAST)
    async def handler(event: Event, session: Any, *, attempt: int) -> None:
        attempts.append(attempt)
        if len(attempts) == 1:
            started.set()
            await asyncio.Event().wait()

    event = order_event()
    task = asyncio.create_task(handler.handle(event))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    record = await db.inbox.find_one({"message_id": event.id})
    if transactional:
        assert record is None  # rolled back, no attempt
    else:
        # The claim let go, its attempt unspent: it held the next delivery off for the rest
        # of the processing lease (60 s).
        assert (record["status"], record["attempts"], "token" in record) == ("retrying", 0, False)
    # The next delivery runs it at once, as the first attempt it still is.
    result = await handler.handle(event)
    assert (result.outcome, result.attempt) == (Outcome.HANDLED, 1)
    assert attempts == [1, 1]


@pytest.mark.parametrize("transactional", MODES)
async def test_a_handler_that_returns_its_work_unawaited_is_never_marked_done(
    db: Any, transactional: bool
) -> None:
    # The effect never ran, and the message was marked done and acknowledged.
    inbox = Inbox(db, consumer="billing", transactional=transactional)

    async def charge() -> None:
        await db.effects.insert_one({"charged": True})

    @inbox_guard(inbox, max_attempts=1, backoff=FAST)
    async def handler(event: Event, session: Any) -> Any:
        return charge()  # forgot the await

    result = await handler.handle(order_event())
    assert result.outcome is Outcome.DEAD_LETTERED
    assert "returned an awaitable it did not await" in (result.error or "")


def test_a_handler_of_the_wrong_signature_is_refused_when_decorated(db: Any) -> None:
    # It was taken, then every delivery failed with a TypeError until dead-lettered.
    async def one_argument(event: Event) -> None: ...

    async def keyword_session(event: Event, *, session: Any) -> None: ...

    for handler in (one_argument, keyword_session):
        with pytest.raises(TypeError, match=r"must take \(event, session\)"):
            inbox_guard(Inbox(db, consumer="billing"))(handler)


async def test_a_transactional_guard_waits_for_a_leased_one_that_holds_the_message(
    db: Any,
) -> None:
    # A deploy that switches a consumer's mode: the transactional guard took a live leased
    # claim for free and ran the effect a second time.
    ran: list[str] = []
    inside = asyncio.Event()
    leave = asyncio.Event()

    @inbox_guard(Inbox(db, consumer="billing", transactional=False), backoff=FAST)
    async def old(event: Event, session: Any) -> None:
        ran.append("old")
        inside.set()
        await leave.wait()

    @inbox_guard(Inbox(db, consumer="billing", transactional=True), backoff=FAST)
    async def new(event: Event, session: Any) -> None:
        ran.append("new")

    event = order_event()
    holding = asyncio.create_task(old.handle(event))
    await inside.wait()
    waiting = await new.handle(event)
    assert (waiting.outcome, waiting.error) == (Outcome.RETRY, "in progress")
    assert 0 < waiting.delay <= 60  # until the leased claim's end (processing_lease) at most
    leave.set()
    assert (await holding).outcome is Outcome.HANDLED
    assert (await new.handle(event)).outcome is Outcome.DUPLICATE
    assert ran == ["old"]
