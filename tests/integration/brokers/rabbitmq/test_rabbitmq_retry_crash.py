"""A ``consume_rabbitmq`` process SIGKILLed on the retry path: between the confirmed copy in
its retry queue and the original's ack, and while the copy waits out its delay. After a
restart every message is handled, its effect exactly once."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from mongo_outbox import Event
from mongo_outbox.consumers import consume_rabbitmq
from tests.crash.retry_consumer_process import RETRY_DELAY, flaky_billing
from tests.support.queues import ready_count
from tests.support.servers import MongoServer
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[4]
TIMEOUT = 60.0


async def start_consumer(mongo: MongoServer, db: Any, queue: str, mode: str, point: str) -> Any:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.crash.retry_consumer_process",
        mongo.uri,
        db.name,
        queue,
        "1" if mode == "transactional" else "0",
        point,
        cwd=ROOT,
    )


@pytest.fixture
async def work_queue(amqp_connection: Any, unique: str) -> Any:
    """A durable work queue holding one event's message; it and its retry queue are deleted
    after the test."""
    channel = await amqp_connection.channel()
    queue = await channel.declare_queue(unique, durable=True)
    event = Event(type="order.placed", aggregate_type="orders", aggregate_id=1)
    await channel.default_exchange.publish(
        aio_pika.Message(
            event.model_dump_json().encode(),
            message_id=event.id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        ),
        routing_key=unique,
    )
    yield channel, queue, event
    await channel.queue_delete(f"{unique}.retry.{int(RETRY_DELAY * 1000)}")
    await queue.delete(if_unused=False, if_empty=False)
    await channel.close()


async def restart_and_settle(db: Any, channel: Any, queue: Any, transactional: bool) -> None:
    """Consume in this process until the retry queue is empty and the copy came back and was
    settled; then stop."""
    retry_queue = f"{queue.name}.retry.{int(RETRY_DELAY * 1000)}"
    stop = asyncio.Event()
    consumer = asyncio.create_task(
        consume_rabbitmq(queue, flaky_billing(db, transactional), stop=stop)
    )

    async def copy_came_back() -> bool:
        return await ready_count(channel, retry_queue) == 0

    await until(copy_came_back, TIMEOUT)

    async def handled() -> bool:
        # The copy left its retry queue a moment before it reaches the work queue (both read
        # empty then): wait for its outcome, not for the queues alone.
        records = await db.inbox.find().to_list(None)
        return bool(records) and all(r["status"] == "done" for r in records)

    await until(handled, TIMEOUT)

    async def work_queue_empty() -> bool:
        return await ready_count(channel, queue.name) == 0

    await until(work_queue_empty, TIMEOUT)
    stop.set()  # a delivery still in flight finishes and settles first
    await asyncio.wait_for(consumer, 20)
    assert await queue.get(fail=False, timeout=1) is None


@pytest.mark.parametrize("mode", ["transactional", "leased"])
async def test_killed_between_the_confirmed_copy_and_the_ack_the_effect_happens_once(
    mongo: MongoServer, db: Any, work_queue: Any, mode: str
) -> None:
    channel, queue, event = work_queue
    process = await start_consumer(mongo, db, queue.name, mode, "after_copy")
    assert await asyncio.wait_for(process.wait(), TIMEOUT) == -signal.SIGKILL
    retry_queue = f"{queue.name}.retry.{int(RETRY_DELAY * 1000)}"

    async def both_in_the_broker() -> bool:
        # The original back in the work queue, the copy in its retry queue (or, after its
        # delay, back in the work queue too).
        return await ready_count(channel, queue.name) + await ready_count(channel, retry_queue) == 2

    await until(both_in_the_broker, TIMEOUT)
    [record] = await db.inbox.find().to_list(None)
    assert (record["status"], record["attempts"]) == ("retrying", 1)

    await restart_and_settle(db, channel, queue, mode == "transactional")
    # The original ran attempt 2; the copy then found the message done: a duplicate.
    assert await db.invoices.find().to_list(None) == [{"_id": event.id, "runs": 1}]
    [record] = await db.inbox.find().to_list(None)
    assert (record["status"], record["attempts"]) == ("done", 2)


@pytest.mark.parametrize("mode", ["transactional", "leased"])
async def test_killed_while_the_retry_waits_its_delay_is_kept_by_the_broker(
    mongo: MongoServer, db: Any, work_queue: Any, mode: str
) -> None:
    channel, queue, event = work_queue
    retry_queue = f"{queue.name}.retry.{int(RETRY_DELAY * 1000)}"
    process = await start_consumer(mongo, db, queue.name, mode, "never")
    try:

        async def waiting_in_retry_queue() -> bool:
            # The retry queue exists once the first attempt failed (and is polled only then:
            # a passive declare of a missing queue closes the channel).
            failed = await db.inbox.count_documents({"status": "retrying"}) == 1
            return failed and await ready_count(channel, retry_queue) == 1

        await until(waiting_in_retry_queue, TIMEOUT)
        seen_waiting = time.monotonic()
        # The consumer acks the original right after the broker confirmed the copy; an ack has
        # no reply to wait for, so give it a moment (well inside the copy's 3 s delay): a kill
        # before it is the other test's case (both the original and the copy come back).
        await asyncio.sleep(0.5)
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    # The original was acknowledged: only the copy is left, and the broker holds it.
    assert await ready_count(channel, queue.name) == 0
    assert await db.invoices.count_documents({}) == 0

    await restart_and_settle(db, channel, queue, mode == "transactional")
    handled_after = time.monotonic() - seen_waiting
    # The delay was served in the broker, across the crash (less the polling that saw it).
    assert handled_after >= RETRY_DELAY - 1.0, f"handled {handled_after:.1f}s after"
    assert await db.invoices.find().to_list(None) == [{"_id": event.id, "runs": 1}]
    [record] = await db.inbox.find().to_list(None)
    assert (record["status"], record["attempts"]) == ("done", 2)
