"""Dead-lettered messages can be listed with filters and requeued: the next delivery runs the
handler again instead of coming back DUPLICATE, and a requeue never reaches a message that a
delivery holds, nor lets the holder of an older claim write to it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mongo_outbox import (
    Backoff,
    ConfigurationError,
    Event,
    Inbox,
    Outcome,
    PoisonMessage,
    UsageError,
    inbox_guard,
)
from mongo_outbox.events import utc_now
from tests.support.waiting import until

FAST = Backoff(initial=0.01, maximum=0.02)
MODES = [True, False]  # transactional, leased


async def poison(db: Any, consumer: str, *events: Event, transactional: bool = False) -> None:
    @inbox_guard(Inbox(db, consumer=consumer, transactional=transactional))
    async def broken(event: Event, session: Any) -> None:
        raise PoisonMessage("a bug")

    for event in events:
        assert (await broken.handle(event)).outcome is Outcome.DEAD_LETTERED


@pytest.mark.parametrize("transactional", MODES)
async def test_a_requeued_dead_letter_runs_the_handler_again_on_its_next_delivery(
    db: Any, transactional: bool
) -> None:
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    fixed = False

    @inbox_guard(inbox, max_attempts=2, backoff=FAST)
    async def bill(event: Event, session: Any) -> None:
        if not fixed:
            raise ValueError("the bug")
        await db.invoices.insert_one({"_id": event.id}, session=session)

    event = Event(type="order.placed", aggregate_type="orders", aggregate_id="o-1")
    assert (await bill.handle(event)).outcome is Outcome.RETRY
    assert (await bill.handle(event)).outcome is Outcome.DEAD_LETTERED
    assert (await bill.handle(event)).outcome is Outcome.DUPLICATE  # as before: nothing changes
    [failed] = await inbox.failed()
    assert failed["message_id"] == event.id and failed["failed_at"] is not None

    fixed = True
    assert await inbox.requeue([event.id]) == 1
    assert await inbox.failed() == []
    result = await bill.handle(event)
    assert (result.outcome, result.attempt) == (Outcome.HANDLED, 1)  # a fresh set of attempts
    assert await db.invoices.count_documents({}) == 1
    assert (await bill.handle(event)).outcome is Outcome.DUPLICATE
    assert await inbox.requeue([event.id]) == 0  # handled, not failed: nothing to requeue


async def test_requeue_chooses_by_id_by_type_or_all_and_only_its_own_consumer(db: Any) -> None:
    placed = [Event(type="order.placed") for _ in range(3)]
    paid = [Event(type="order.paid") for _ in range(2)]
    await poison(db, "billing", *placed, *paid)
    await poison(db, "mailer", placed[0])
    billing = Inbox(db, consumer="billing")

    assert await billing.requeue([placed[0].id, paid[0].id], event_type="order.paid") == 1
    assert await billing.requeue(event_type="order.placed") == 3
    assert await billing.requeue(all_failed=True) == 1
    assert await billing.failed() == []
    assert [r["message_id"] for r in await Inbox(db, consumer="mailer").failed()] == [placed[0].id]


async def test_failed_filters_by_type_and_time_and_lists_the_latest_first(db: Any) -> None:
    early = [Event(type="order.placed"), Event(type="order.paid")]
    await poison(db, "billing", *early)
    middle = utc_now()
    await asyncio.sleep(0.01)
    late = [Event(type="order.placed"), Event(type="order.placed")]
    await poison(db, "billing", *late)
    inbox = Inbox(db, consumer="billing")

    def ids(records: list[dict[str, Any]]) -> list[str]:
        return [r["message_id"] for r in records]

    assert ids(await inbox.failed()) == [e.id for e in reversed(early + late)]
    assert ids(await inbox.failed(event_type="order.paid")) == [early[1].id]
    assert ids(await inbox.failed(since=middle)) == [e.id for e in reversed(late)]
    assert ids(await inbox.failed(event_type="order.placed", limit=2)) == [late[1].id, late[0].id]
    record = (await inbox.failed(limit=1))[0]
    assert record["event"]["id"] == late[1].id and record["last_error"]


async def test_requeue_leaves_a_message_that_a_delivery_holds_alone(db: Any) -> None:
    await poison(db, "mailer", Event(type="warmup"))  # a failed record of another message
    gate, running = asyncio.Event(), asyncio.Event()
    inbox = Inbox(db, consumer="mailer", transactional=False)

    @inbox_guard(inbox)
    async def send(event: Event, session: Any) -> None:
        running.set()
        await gate.wait()

    event = Event(type="order.placed")
    delivery = asyncio.create_task(send.handle(event))
    await asyncio.wait_for(running.wait(), 10)
    assert await inbox.requeue([event.id]) == 0
    assert await inbox.requeue(event_type="order.placed") == 0
    gate.set()
    assert (await delivery).outcome is Outcome.HANDLED
    record = await inbox.collection.find_one({"message_id": event.id})
    assert record is not None and record["status"] == "done"


async def test_a_holder_of_an_older_claim_cannot_write_to_a_requeued_message(db: Any) -> None:
    """The first delivery overruns its lease; the second takes the message over and
    dead-letters it; an operator requeues it; then the first ends. Its "done" must match
    nothing, so the message is still handled by the next delivery."""
    gate, first_running = asyncio.Event(), asyncio.Event()
    effects: list[int] = []

    def consumer(n: int) -> Any:
        inbox = Inbox(db, consumer="mailer", transactional=False, processing_lease=0.3)

        @inbox_guard(inbox, backoff=FAST)
        async def send(event: Event, session: Any) -> None:
            if n == 1:
                first_running.set()
                await gate.wait()
            elif n == 2:
                raise PoisonMessage("the bug")
            effects.append(n)

        return send

    first, second, third = consumer(1), consumer(2), consumer(3)
    event = Event(type="order.placed")
    stale = asyncio.create_task(first.handle(event))
    await asyncio.wait_for(first_running.wait(), 10)
    taken_over: list[Outcome] = []

    async def second_delivery() -> bool:
        result = await second.handle(event)  # retried until the first's lease runs out
        taken_over.append(result.outcome)
        return result.outcome is Outcome.DEAD_LETTERED

    await until(second_delivery, timeout=10, every=0.1)
    inbox = Inbox(db, consumer="mailer")
    assert await inbox.requeue([event.id]) == 1
    gate.set()
    await stale  # its "done" is fenced out: it held a claim the requeue ended
    record = await inbox.collection.find_one({"message_id": event.id})
    assert record is not None and record["status"] == "retrying" and "token" not in record
    result = await third.handle(event)
    assert (result.outcome, result.attempt) == (Outcome.HANDLED, 1)
    assert effects == [1, 3]


async def test_concurrent_deliveries_of_a_requeued_message_run_the_handler_once(db: Any) -> None:
    event = Event(type="order.placed")
    await poison(db, "mailer", event)
    assert await Inbox(db, consumer="mailer").requeue([event.id]) == 1
    gate, runs = asyncio.Event(), []

    def consumer() -> Any:
        @inbox_guard(Inbox(db, consumer="mailer", transactional=False))
        async def send(event: Event, session: Any) -> None:
            runs.append(1)
            await gate.wait()

        return send

    first = asyncio.create_task(consumer().handle(event))
    await until(lambda: bool(runs))
    other = await consumer().handle(event)
    assert other.outcome is Outcome.RETRY and other.error == "in progress"
    gate.set()
    assert (await first).outcome is Outcome.HANDLED and len(runs) == 1


async def test_requeue_and_failed_refuse_what_they_cannot_mean(db: Any) -> None:
    inbox = Inbox(db, consumer="billing")
    for call in (
        inbox.requeue(),
        inbox.requeue("one-id"),  # type: ignore[arg-type]
        inbox.requeue(["x"], all_failed=True),
        inbox.requeue(event_type="t", all_failed=True),
        inbox.failed(since="yesterday"),  # type: ignore[arg-type]
    ):
        with pytest.raises(UsageError):
            await call
    with pytest.raises(ConfigurationError):
        await inbox.failed(limit=0)
    assert await inbox.requeue([]) == 0


async def test_a_requeue_of_many_long_ids_goes_out_in_commands_under_16_mib(db: Any) -> None:
    # All the ids went into one `$in`: 120 ids of 160 KB made a command over 16 MiB, which
    # PyMongo refused (DocumentTooLarge) before sending, and nothing was requeued.
    # (Message ids of any source: longer than an Event's own may be.)
    events = [Event(type="order.placed") for _ in range(2)]
    await poison(db, "billing", *events)
    inbox = Inbox(db, consumer="billing")
    asked = [f"{n:03}" + "x" * 160_000 for n in range(120)] + [e.id for e in events]
    assert await inbox.requeue(asked) == 2
    assert await inbox.failed() == []
