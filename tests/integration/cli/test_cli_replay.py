"""``mongo-outbox replay``, the real console script: already-published events go out again,
under their own ids and in order per aggregate, to the real RabbitMQ and NATS."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from mongo_outbox import Event, Outbox, PollingRelay, RelaySettings
from mongo_outbox.publishers import MemoryPublisher
from tests.support.cli import cli, environment
from tests.support.servers import NATS_URL, RABBITMQ_URL, MongoServer


async def published_history(db: Any) -> list[Event]:
    """Three aggregates (ids 1, 2 and "o-3"), each placed, paid, shipped (o-3's shipping at
    version 2), all published; and one pending and one parked event, which a replay must leave
    out."""
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    events: list[Event] = []
    for step in ("order.placed", "order.paid", "order.shipped"):
        for doc_id in (1, 2, "o-3"):
            version = 2 if (step, doc_id) == ("order.shipped", "o-3") else 1
            saved = await outbox.save_with_events(
                None, db.orders, {"_id": doc_id}, [Event(type=step, version=version)]
            )
            events += saved.events
    await outbox.save_with_events(None, db.orders, {"_id": "poison"}, [Event(type="bad")])
    broken = MemoryPublisher(fail=lambda e: ValueError("no") if e.type == "bad" else None)
    assert await PollingRelay(outbox, broken, settings=RelaySettings(max_attempts=1)).drain() == 9
    await outbox.save_with_events(None, db.orders, {"_id": "late"}, [Event(type="order.placed")])
    return events


def in_order(received: list[Event]) -> bool:
    sequences: dict[Any, list[int]] = defaultdict(list)
    for event in received:
        sequences[event.aggregate_id].append(event.sequence or 0)
    return all(s == sorted(s) for s in sequences.values())


async def drain_queue(queue: Any) -> list[tuple[str, Event]]:
    received = []
    while (message := await queue.get(fail=False, timeout=5)) is not None:
        await message.ack()
        received.append((str(message.message_id), Event.from_json(message.body)))
    return received


async def rabbitmq_queue(channel: Any, unique: str, *keys: str) -> Any:
    import aio_pika

    exchange = await channel.declare_exchange(unique, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(unique, exclusive=True)
    for key in keys:
        await queue.bind(exchange, key)
    return queue


async def test_replay_republishes_published_events_in_order_under_their_own_ids(
    mongo: MongoServer, db: Any, channel: Any, unique: str
) -> None:
    events = await published_history(db)
    queue = await rabbitmq_queue(channel, unique, "#")
    where = [f"--uri={mongo.uri}", f"--db={db.name}"]
    broker = [f"--rabbitmq={RABBITMQ_URL}", f"--exchange={unique}"]

    dry = await cli("replay", *where, *broker, "--since=1h", "--dry-run")
    assert dry.out.splitlines() == [
        "would republish 9 events of 3 aggregates",
        "  TYPE           VERSION  EVENTS",
        "  order.paid     v1       3",
        "  order.placed   v1       3",
        "  order.shipped  v1       2",
        "  order.shipped  v2       1",
    ], dry.output
    assert await drain_queue(queue) == []

    ran = await cli("replay", *where, *broker, "--since=1h")
    assert ran.code == 0, ran.output
    assert ran.out.startswith("republished 9 of 9 events of 3 aggregates to RabbitMQ")
    assert "guest" not in ran.out  # the password, and so the user of the same name, is hidden
    received = await drain_queue(queue)
    assert sorted(message_id for message_id, _ in received) == sorted(e.id for e in events)
    assert all(message_id == event.id for message_id, event in received)
    assert in_order([event for _, event in received])

    paid = await cli("replay", *where, *broker, "--since=1h", "--type=order.paid")
    assert paid.out.startswith("republished 3 of 3 events")
    assert {e.type for _, e in await drain_queue(queue)} == {"order.paid"}
    one = await cli("replay", *where, *broker, "--since=1h", "--aggregate=1", "--aggregate=o-3")
    assert one.out.startswith("republished 6 of 6 events of 2 aggregates")
    assert {e.aggregate_id for _, e in await drain_queue(queue)} == {1, "o-3"}
    future = await cli("replay", *where, *broker, "--since=2999-01-01")
    assert future.out.startswith("republished 0 of 0 events")
    assert f"no published event {db.name}.outbox keeps occurred since 2999-01-01" in future.err
    misspelled = await cli("replay", *where, *broker, "--since=1h", "--type=order.piad")
    assert misspelled.code == 0 and misspelled.out.startswith("republished 0 of 0 events")
    assert ", of type order.piad: a type and an aggregate id match exactly" in misspelled.err
    assert "no published event" not in paid.err + one.err
    elsewhere = await cli("replay", f"--uri={mongo.uri}", f"--db={db.name}x", *broker, "--since=1h")
    assert elsewhere.code == 0 and f"no published event {db.name}x.outbox keeps" in elsewhere.err
    assert "a misspelled --db has none" in elsewhere.err


async def test_replay_reaches_a_new_nats_stream(
    mongo: MongoServer, db: Any, nats_client: Any, nats_stream: str
) -> None:
    events = await published_history(db)
    ran = await cli(
        "replay",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        f"--nats={NATS_URL}",
        f"--subject={nats_stream}.{{type}}",
        "--since=10m",
    )
    assert ran.code == 0, ran.output
    js = nats_client.jetstream()
    assert (await js.stream_info(nats_stream)).state.messages == 9
    sub = await js.subscribe(f"{nats_stream}.>", ordered_consumer=True)
    received = [Event.from_json((await sub.next_msg(timeout=5)).data) for _ in range(9)]
    assert sorted(e.id for e in received) == sorted(e.id for e in events)
    assert in_order(received)


async def test_a_failed_event_stops_its_aggregate_and_the_replay_exits_non_zero(
    mongo: MongoServer, db: Any, channel: Any, unique: str
) -> None:
    await published_history(db)
    # Paid orders have no queue: RabbitMQ returns them, and their shipping must not overtake.
    queue = await rabbitmq_queue(channel, unique, "order.placed", "order.shipped")
    ran = await cli(
        "replay",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        f"--rabbitmq={RABBITMQ_URL}",
        f"--exchange={unique}",
        "--since=1h",
    )
    assert ran.code == 1
    assert ran.out.startswith("republished 3 of 9 events")
    [line] = ran.err.splitlines()
    assert line.startswith("mongo-outbox: 3 events failed (") and "3 later events" in line
    assert [e.type for _, e in await drain_queue(queue)] == ["order.placed"] * 3


async def test_replay_refuses_an_embedded_outbox_in_one_line(mongo: MongoServer, db: Any) -> None:
    ran = await cli(
        "replay",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        "--mode=embedded",
        "--collections=orders",
        "--nats=nats://127.0.0.1:1",  # never contacted
        "--since=1h",
    )
    assert ran.code == 1 and ran.out == ""
    [line] = ran.err.splitlines()
    assert "replay needs collection mode" in line


@pytest.mark.parametrize("since", ["yesterday", "3x"])
async def test_replay_refuses_a_time_it_cannot_read(
    mongo: MongoServer, db: Any, since: str
) -> None:
    ran = await cli("replay", f"--uri={mongo.uri}", "--nats=nats://x:4222", f"--since={since}")
    assert ran.code == 1 and "--since" in ran.err and len(ran.err.splitlines()) == 1
    assert json.dumps(ran.out) == '""'


async def test_the_dry_run_twin_in_the_environment_sends_nothing(
    mongo: MongoServer, db: Any, channel: Any, unique: str
) -> None:
    await published_history(db)
    queue = await rabbitmq_queue(channel, unique, "#")
    twins = environment(
        MONGO_OUTBOX_URI=mongo.uri,
        MONGO_OUTBOX_DB=db.name,
        MONGO_OUTBOX_RABBITMQ=RABBITMQ_URL,
        MONGO_OUTBOX_EXCHANGE=unique,
        MONGO_OUTBOX_SINCE="1h",
        MONGO_OUTBOX_DRY_RUN="1",
    )

    ran = await cli("replay", env=twins)

    assert ran.code == 0, ran.output
    assert ran.out.splitlines()[0] == "would republish 9 events of 3 aggregates", ran.output
    assert await drain_queue(queue) == []


async def test_a_dry_run_needs_no_broker_and_a_replay_does(mongo: MongoServer, db: Any) -> None:
    # It demanded --nats or --rabbitmq, and so a broker that answers, to send nothing.
    await published_history(db)
    where = [f"--uri={mongo.uri}", f"--db={db.name}", "--since=1h"]

    ran = await cli("replay", *where, "--dry-run")

    assert ran.code == 0, ran.output
    assert ran.out.splitlines() == [
        "would republish 9 events of 3 aggregates",
        "  TYPE           VERSION  EVENTS",
        "  order.paid     v1       3",
        "  order.placed   v1       3",
        "  order.shipped  v1       2",
        "  order.shipped  v2       1",
    ]
    refused = await cli("replay", *where)
    assert refused.code == 1 and refused.out == ""
    assert refused.err.strip() == "mongo-outbox: name one broker: --nats URL or --rabbitmq URL"


async def test_an_until_before_the_since_is_refused(mongo: MongoServer, db: Any) -> None:
    await published_history(db)
    where = [f"--uri={mongo.uri}", f"--db={db.name}", f"--rabbitmq={RABBITMQ_URL}"]

    ran = await cli("replay", *where, "--since=1h", "--until=2h", "--dry-run")

    assert ran.code == 1, ran.output
    assert "--until 2h" in ran.err and "is not after --since 1h" in ran.err
    assert ran.out == ""


async def test_a_replay_to_a_subject_no_stream_takes_says_it_fails_them(
    mongo: MongoServer, db: Any, unique: str
) -> None:
    await published_history(db)
    where = [f"--uri={mongo.uri}", f"--db={db.name}", f"--nats={NATS_URL}"]

    ran = await cli("replay", *where, f"--subject={unique}.{{type}}", "--since=1h")

    assert ran.code == 1, ran.output
    assert "until a stream does" not in ran.err
    assert "the replay fails the events no stream takes, and does not wait for one" in ran.err
    assert "events failed" in ran.err
