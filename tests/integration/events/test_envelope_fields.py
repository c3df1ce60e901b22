"""Messages from a newer producer, whose envelope has top-level fields this version does not
know, are handled once through the real NATS and RabbitMQ consumers and ``inbox_guard``: two
consumers at once, every message delivered twice. They were refused as "not an Event" (NATS:
terminated; RabbitMQ: dropped without a dead-letter exchange) and left no inbox record."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aio_pika

from mongo_outbox import Event, Inbox, inbox_guard
from mongo_outbox.consumers import consume_nats, consume_rabbitmq
from tests.support.billing import guarded_billing, wait_for_invoices

# What a newer producer might add beside the fields of Event.
NEWER = {"schema": "2.0", "tenant": {"id": "acme", "region": ["eu", 1]}, "trace": None}


def newer_events(count: int) -> list[tuple[Event, bytes]]:
    """Events, each with the body a newer producer sends for it."""
    events = [
        Event(type="order.placed", payload={"n": n}, aggregate_type="orders", aggregate_id=n)
        for n in range(count)
    ]
    return [(e, json.dumps(e.model_dump(mode="json") | NEWER).encode()) for e in events]


async def records(db: Any) -> list[dict[str, Any]]:
    return await db.inbox.find({"consumer": "billing"}).to_list(None)


async def test_two_nats_consumers_handle_each_newer_message_once(
    db: Any, nats_client: Any, unique: str
) -> None:
    sent = newer_events(4)
    js = nats_client.jetstream()
    # A short duplicate window, so that both copies of each message are stored and delivered.
    await js.add_stream(name=unique, subjects=[f"{unique}.>"], duplicate_window=0.1)
    try:
        for copy in range(2):
            for event, body in sent:
                await js.publish(f"{unique}.orders", body, headers={"Nats-Msg-Id": event.id})
            if copy == 0:
                await asyncio.sleep(0.2)
        assert (await js.stream_info(unique)).state.messages == 8
        rejected: list[str] = []

        async def on_rejected(body: bytes, reason: str) -> None:
            rejected.append(reason)

        stop = asyncio.Event()
        consumers = [
            asyncio.create_task(
                consume_nats(
                    js,
                    f"{unique}.>",
                    "billing",
                    guarded_billing(db),  # one guard each, as in two processes
                    stream=unique,
                    batch=4,
                    rejected=on_rejected,
                    stop=stop,
                )
            )
            for _ in range(2)
        ]
        invoices = await wait_for_invoices(db, len(sent))
        stop.set()
        await asyncio.wait_for(asyncio.gather(*consumers), 10)

        assert rejected == []
        assert invoices == {event.id: 1 for event, _ in sent}
        stored = {r["message_id"]: r for r in await records(db)}
        assert stored.keys() == {event.id for event, _ in sent}
        assert {r["status"] for r in stored.values()} == {"done"}
        info = await js.consumer_info(unique, "billing")
        assert info.num_pending == 0 and info.num_ack_pending == 0
    finally:
        await js.delete_stream(unique)


async def test_two_rabbitmq_consumers_handle_each_newer_message_once(
    db: Any, amqp_connection: Any, unique: str
) -> None:
    sent = newer_events(4)
    first, second = await amqp_connection.channel(), await amqp_connection.channel()
    queue = await first.declare_queue(unique, exclusive=True)  # gone with the connection
    for _ in range(2):
        for event, body in sent:
            message = aio_pika.Message(body, message_id=event.id)
            await first.default_exchange.publish(message, routing_key=unique)
    rejected: list[str] = []

    async def on_rejected(body: bytes, reason: str) -> None:
        rejected.append(reason)

    stop = asyncio.Event()
    consumers = [
        asyncio.create_task(
            consume_rabbitmq(q, guarded_billing(db), rejected=on_rejected, stop=stop)
        )
        # Declared on each channel: both consumers make the same exclusive retry queues.
        for q in (queue, await second.declare_queue(unique, exclusive=True))
    ]
    invoices = await wait_for_invoices(db, len(sent))
    stop.set()
    await asyncio.wait_for(asyncio.gather(*consumers), 10)

    assert rejected == []
    assert invoices == {event.id: 1 for event, _ in sent}
    stored = await records(db)
    assert sorted(r["message_id"] for r in stored) == sorted(event.id for event, _ in sent)
    assert await queue.get(fail=False, timeout=1) is None  # every copy settled, none dropped
    await queue.delete()
    await first.close()
    await second.close()


async def test_the_guard_handles_a_newer_message_delivered_twice_at_once_once(db: Any) -> None:
    [(event, body)] = newer_events(1)
    runs: list[Event] = []

    @inbox_guard(Inbox(db, consumer="billing", transactional=False))
    async def bill(received: Event, session: Any) -> None:
        runs.append(received)
        await asyncio.sleep(0.05)  # the second delivery arrives while the first runs

    outcomes = await asyncio.gather(bill(Event.from_json(body)), bill(Event.from_json(body)))

    assert sorted(outcomes) == [False, True]
    assert runs == [event]  # as sent, less what this version does not know
    [record] = await records(db)
    assert record["status"] == "done" and record["message_id"] == event.id
