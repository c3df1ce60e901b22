"""Every exit of a guarded attempt leaves the record in a state the next delivery can act on:
fenced claims, a dead letter that fails, a crash after the last attempt, the broker's last
delivery."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import pytest

from mongo_outbox import Backoff, Event, Inbox, Outcome, inbox_guard
from mongo_outbox.events import utc_now

FAST = Backoff(initial=0.01, maximum=0.02)
MODES = [True, False]  # transactional, leased


def order_event(n: int = 1) -> Event:
    return Event(type="order.placed", payload={"total": n}, aggregate_type="orders", aggregate_id=n)


async def until(condition: Any, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def test_a_holder_whose_lease_ran_out_cannot_overwrite_the_live_claim(
    db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Three consumers of one name (guards of their own, as separate processes would have).
    The first overruns its lease; the second takes the message over; then the first fails.
    Its failure must not release the second's claim to the third."""
    release_first, release_second = asyncio.Event(), asyncio.Event()
    running: list[int] = []

    def consumer(n: int) -> Any:
        # Only the first's lease is short: the second's must outlast the test, or a loaded
        # machine's stall let it run out too, and the third rightly took the message over.
        lease = 0.3 if n == 1 else 60.0
        inbox = Inbox(db, consumer="mailer", transactional=False, processing_lease=lease)

        @inbox_guard(inbox, backoff=FAST)
        async def send_mail(event: Event, session: Any) -> None:
            running.append(n)
            if n == 1:
                await release_first.wait()
                raise ConnectionError("SMTP timed out")
            if n == 2:
                await release_second.wait()

        return send_mail

    first, second, third = consumer(1), consumer(2), consumer(3)
    event = order_event()
    first_run = asyncio.create_task(first.handle(event))
    await until(lambda: running == [1])
    while True:  # the second delivery waits out the first's lease, as the broker would
        second_run = asyncio.create_task(second.handle(event))
        await until(lambda run=second_run: run.done() or running == [1, 2])
        if running == [1, 2]:
            break
        result = second_run.result()
        assert (result.outcome, result.error) == (Outcome.RETRY, "in progress")
        await asyncio.sleep(result.delay)

    release_first.set()
    assert (await first_run).outcome is Outcome.RETRY  # its failure, recorded nowhere
    record = await db.inbox.find_one({"message_id": event.id})
    assert (record["status"], record["attempts"]) == ("processing", 2)
    assert "ran out" in caplog.text

    third_result = await third.handle(event)
    assert (third_result.outcome, third_result.error) == (Outcome.RETRY, "in progress")
    assert running == [1, 2]  # the handler never ran beside the live holder

    release_second.set()
    assert (await second_run).outcome is Outcome.HANDLED
    assert (await third.handle(event)).outcome is Outcome.DUPLICATE
    record = await db.inbox.find_one({"message_id": event.id})
    assert (record["status"], record["attempts"]) == ("done", 2)
    assert "token" not in record and "lease_until" not in record


@pytest.mark.parametrize("transactional", MODES)
async def test_a_failing_dead_letter_releases_the_message_and_never_reruns_the_handler(
    db: Any, transactional: bool
) -> None:
    """The handler is done with the message after ``max_attempts``; while the dead letter fails,
    redeliveries retry only the dead letter, at once (not after a 60 s lease)."""
    inbox = Inbox(db, consumer="c", transactional=transactional, processing_lease=60)
    outages = 2
    runs: list[int] = []
    dead: list[str] = []

    async def dead_letter(event: Event, reason: str) -> None:
        nonlocal outages
        if outages:
            outages -= 1
            raise ConnectionError("DLQ down")
        dead.append(reason)

    @inbox_guard(inbox, max_attempts=2, backoff=FAST, dead_letter=dead_letter)
    async def handler(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(attempt)
        raise ValueError("always broken")

    event = order_event()
    outcomes = [await handler.handle(event) for _ in range(4)]
    assert [(r.outcome, r.attempt) for r in outcomes] == [
        (Outcome.RETRY, 1),
        (Outcome.RETRY, 2),  # out of attempts; the dead letter failed
        (Outcome.RETRY, 2),  # the dead letter failed again; the handler did not run
        (Outcome.DEAD_LETTERED, 2),
    ]
    assert [r.error for r in outcomes[1:3]] == ["dead letter failed: ConnectionError: DLQ down"] * 2
    assert runs == [1, 2]
    assert len(dead) == 1 and "gave up after 2: ValueError: always broken" in dead[0]
    [record] = await inbox.failed()
    assert record["attempts"] == 2 and "verdict" not in record
    assert (await handler.handle(event)).outcome is Outcome.DUPLICATE


async def test_a_crash_in_the_last_attempt_is_dead_lettered_without_another_run(db: Any) -> None:
    attempts: list[int] = []
    dead: list[str] = []

    async def dead_letter(event: Event, reason: str) -> None:
        dead.append(reason)

    started = asyncio.Event()

    async def mail(event: Event, session: Any, *, attempt: int) -> None:
        attempts.append(attempt)
        if attempt == 2:
            started.set()
            await asyncio.Event().wait()  # until the process dies inside its last attempt
        raise ConnectionError("SMTP timed out")

    def guarded() -> Any:
        inbox = Inbox(db, consumer="mailer", transactional=False, processing_lease=0.3)
        return inbox_guard(inbox, max_attempts=2, backoff=FAST, dead_letter=dead_letter)(mail)

    # Two processes: the first never comes back from its last attempt (a crash: nothing after
    # it runs, where a cancellation is a stop that lets the claim go).
    crashed, send_mail = guarded(), guarded()
    event = order_event()
    assert (await crashed.handle(event)).outcome is Outcome.RETRY
    dying = asyncio.create_task(crashed.handle(event))
    await started.wait()
    for _ in range(100):
        result = await send_mail.handle(event)
        if result.error != "in progress":
            break
        await asyncio.sleep(result.delay)  # the ghost's lease runs out, as the broker waits
    assert (result.outcome, result.attempt) == (Outcome.DEAD_LETTERED, 2)
    assert attempts == [1, 2]
    assert dead == ["gave up after 2; last error recorded: ConnectionError: SMTP timed out"]
    dying.cancel()  # its claim was taken over: letting it go now changes nothing
    with pytest.raises(asyncio.CancelledError):
        await dying
    assert (await db.inbox.find_one({"message_id": event.id}))["status"] == "failed"


@pytest.mark.parametrize("transactional", MODES)
async def test_a_failure_on_the_broker_s_last_delivery_is_dead_lettered(
    db: Any, transactional: bool
) -> None:
    dead: list[str] = []

    async def dead_letter(event: Event, reason: str) -> None:
        dead.append(reason)

    @inbox_guard(
        Inbox(db, consumer="c", transactional=transactional),
        max_attempts=5,
        backoff=FAST,
        dead_letter=dead_letter,
    )
    async def handler(event: Event, session: Any) -> None:
        raise ValueError("always broken")

    event = order_event()
    assert (await handler.handle(event)).outcome is Outcome.RETRY
    result = await handler.handle(event, last_delivery=True)
    assert (result.outcome, result.attempt) == (Outcome.DEAD_LETTERED, 2)
    assert dead == ["gave up after 2 on the broker's last delivery: ValueError: always broken"]
    [record] = await db.inbox.find().to_list(None)
    assert (record["status"], record["attempts"]) == ("failed", 2)


async def test_on_the_last_delivery_a_retry_that_is_not_the_message_s_fault_stays_a_retry(
    db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Another consumer holds the message: dead-lettering it would undo that consumer's work."""
    caplog.set_level(logging.ERROR)
    inbox = Inbox(db, consumer="c", transactional=False, processing_lease=30)
    event = order_event()
    await inbox.ensure_indexes()
    await db.inbox.insert_one(
        {"consumer": "c", "source": "orders", "message_id": event.id, "status": "processing"}
        | {"attempts": 1, "token": "elsewhere", "lease_until": utc_now() + timedelta(seconds=30)}
    )

    @inbox_guard(inbox)
    async def handler(event: Event, session: Any) -> None:
        raise AssertionError("not while another consumer holds it")

    result = await handler.handle(event, last_delivery=True)
    assert (result.outcome, result.error) == (Outcome.RETRY, "in progress")
    assert "dead-lettering" not in caplog.text
