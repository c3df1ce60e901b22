"""RabbitMQ's confirms, against the real broker, with several waves in flight on one publisher:
every event the publisher reports published is in the queue (none falsely confirmed), and every
event the relay marks published is in the queue (none lost), as counted by a consumer of its
own. The queue is at ``x-max-length`` with ``reject-publish`` (the broker nacks what does not
fit, and flushes acks before nacks, so single confirms come out of order), and some routing keys
have no queue (``basic.return``, then the confirm)."""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika

from mongo_outbox import (
    Backoff,
    BrokerFullError,
    BrokerUnavailableError,
    Event,
    PollingRelay,
    RelaySettings,
)
from mongo_outbox.publishers import RabbitMQPublisher
from tests.support.outboxes import make_outbox
from tests.support.servers import RABBITMQ_URL

WAVE = 128  # the relay's chunk: max_in_flight 256 in two halves


async def full_queue(channel: Any, exchange: str, length: int) -> Any:
    """A queue bound for ``kept.#`` on ``exchange`` that holds ``length`` messages and nacks
    more (``reject-publish``); ``lost.*`` has no queue."""
    declared = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(
        exclusive=True, arguments={"x-max-length": length, "x-overflow": "reject-publish"}
    )
    await queue.bind(declared, "kept.#")
    return queue


async def consumed_ids(queue: Any) -> list[str]:
    """The ``message_id`` of every message in ``queue``, read by a consumer of the test's own."""
    ids = []
    while (message := await queue.get(fail=False, timeout=5)) is not None:
        await message.ack()
        ids.append(message.message_id)
    return ids


def kept_or_lost(n: int, wave: int) -> Event:
    # Every seventh has no queue; the rest fill the queue, then are nacked.
    kind = "lost.x" if n % 7 == 3 else "kept.x"
    return Event(type=kind, payload={"n": n, "wave": wave}, aggregate_id=n)


async def test_concurrent_waves_report_published_exactly_what_the_queue_holds(
    channel: Any, unique: str
) -> None:
    queue = await full_queue(channel, unique, length=300)
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique, timeout=10)
    waves = [[kept_or_lost(n, wave) for n in range(WAVE)] for wave in range(6)]
    # One message in two copies, in two waves in flight at once: the first routed, the second
    # (another routing key) returned.
    twin = waves[0][0].model_copy(update={"type": "kept.twin"})
    waves[0][0] = twin
    waves[1][0] = twin.model_copy(update={"type": "lost.twin"})
    try:
        outcomes = await asyncio.gather(*(publisher.publish_many(wave) for wave in waves))
    finally:
        await publisher.aclose()
    held = await consumed_ids(queue)
    assert len(held) == 300 == len(set(held))
    published = [e for wave, results in zip(waves, outcomes, strict=True) for e, r in
                 zip(wave, results, strict=True) if r is None]  # fmt: skip
    assert sorted(e.id for e in published) == sorted(held), "falsely confirmed or unreported"
    for wave, results in zip(waves, outcomes, strict=True):
        for sent, result in zip(wave, results, strict=True):
            if sent.type.startswith("lost."):
                assert isinstance(result, BrokerUnavailableError), (sent.type, result)
                assert result.destination == sent.type and "NO_ROUTE" in str(result)
            elif result is not None:
                assert isinstance(result, BrokerFullError), result
    assert outcomes[0][0] is None and outcomes[1][0] is not None  # the twins, each its own


async def test_two_copies_of_one_message_in_flight_are_never_both_reported_published_unrouted(
    channel: Any, unique: str
) -> None:
    # Identical copies, one wave each, all unroutable: each is reported returned. And copies
    # routed by the same key all are reported published.
    await full_queue(channel, unique, length=1_000)
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique, timeout=10)
    lost = [Event(type="lost.copy", payload={"n": n}) for n in range(WAVE)]
    kept = [Event(type="kept.copy", payload={"n": n}) for n in range(WAVE)]
    try:
        outcomes = await asyncio.gather(
            *(publisher.publish_many([*lost, *kept][i::2]) for i in range(2)),
            *(publisher.publish_many([*lost, *kept][i::2]) for i in range(2)),
        )
    finally:
        await publisher.aclose()
    for results, sent in zip(outcomes, [[*lost, *kept][i::2] for i in (0, 1, 0, 1)], strict=True):
        for event, result in zip(sent, results, strict=True):
            if event.type == "lost.copy":
                assert isinstance(result, BrokerUnavailableError), result
            else:
                assert result is None, result


async def test_a_relay_with_two_chunks_in_flight_marks_published_only_what_the_queue_holds(
    db: Any, channel: Any, unique: str
) -> None:
    # A slow consumer keeps the queue about full: acks and nacks interleave all along.
    queue = await full_queue(channel, unique, length=20)
    outbox = make_outbox(db)
    await outbox.ensure_indexes()
    # Chunks of 32 (half of max_in_flight): two in flight at once, ten in the round. (With the
    # default 128 it took 1,000 events to have eight: the emulator then spent 10 s of a loaded
    # machine's CPU on one claim of them, over 20 s with more load, and PyMongo's heartbeat,
    # unanswered for its 20 s, interrupted the relay's command: `_OperationCancelled`.)
    batch_size = 300
    saved: list[Event] = []
    for n in range(batch_size):
        kind = "lost.x" if n % 9 == 4 else "kept.x"
        result = await outbox.save_with_events(None, db.orders, {"_id": n}, [Event(type=kind)])
        saved += result.events
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique, timeout=10)
    settings = RelaySettings(
        batch_size=batch_size, max_in_flight=64, backoff=Backoff(initial=60, maximum=60)
    )
    relay = PollingRelay(outbox, publisher, settings=settings)
    held: list[str] = []
    draining = True

    async def consume() -> None:
        while draining:
            message = await queue.get(fail=False)
            if message is None:
                await asyncio.sleep(0.001)
                continue
            await message.ack()
            held.append(message.message_id)

    consumer = asyncio.create_task(consume())
    try:
        await relay.drain()
    finally:
        draining = False
        await consumer
        await publisher.aclose()
    held += await consumed_ids(queue)
    marked = set(await db.outbox.distinct("_id", {"status": "published"}))
    assert len(held) == len(set(held)) and marked <= {e.id for e in saved}
    assert sorted(marked) == sorted(held), (
        f"{len(marked - set(held))} marked published are in no queue (lost), "
        f"{len(set(held) - marked)} in the queue are not marked"
    )


async def test_a_wave_its_caller_gave_up_before_it_was_queued_takes_no_delivery_tags(
    channel: Any, unique: str
) -> None:
    # More waves at once than aiormq's write queue holds (10 entries): the eleventh waits for
    # room, and the ones after it for their turn. Its caller gives up there, so it is never
    # written: the waves behind it must not count the delivery tags it would have taken, or
    # each of their messages would be settled by the confirm of the one 3 places after it.
    declared = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    full = await channel.declare_queue(
        exclusive=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
    )
    await full.bind(declared, "full.#")  # nacks every message
    kept = await channel.declare_queue(exclusive=True)
    await kept.bind(declared, "kept.#")
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique, timeout=2)
    # Waves of 3 (an odd shift), nacked and routed in turn across them all.
    sent = [Event(type=("full.x", "kept.x")[n % 2], payload={"n": n}) for n in range(60)]
    waves = [sent[start : start + 3] for start in range(0, len(sent), 3)]
    try:
        assert await publisher.publish_many([Event(type="kept.x")]) == [None]  # channel open
        tasks = [asyncio.create_task(publisher.publish_many(wave)) for wave in waves]
        await asyncio.sleep(0)  # each wave written, or waiting for room or for its turn
        tasks[10].cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await publisher.aclose()
    assert isinstance(outcomes[10], asyncio.CancelledError)
    held = set(await consumed_ids(kept))
    published = [
        e.id
        for wave, results in zip(waves, outcomes, strict=True)
        if isinstance(results, list)
        for e, r in zip(wave, results, strict=True)
        if r is None
    ]
    lost = set(published) - held
    assert published and not lost, f"{len(lost)} reported published are in no queue"
