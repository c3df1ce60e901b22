"""Evolving events end to end, through the relay, the real NATS JetStream and the real
``mongo-outbox`` command line: a version 1 event read by a consumer deployed with version 3
and its upcasters, through redeliveries and replays, each effect once and seen as version 3;
a consumer without the step it needs, or too old for a version, dead-letters the event with
nothing lost, and handles it once a reader that knows it is deployed and the dead letter is
requeued. A FastStream subscriber with ``payload=Model`` gets the payload at its model's
version."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any, ClassVar

import pytest
from faststream.nats import ConsumerConfig, JStream, NatsBroker
from nats.js.errors import NotFoundError
from pydantic import BaseModel

from mongo_outbox import (
    Backoff,
    ConfigurationError,
    Event,
    Inbox,
    Outbox,
    Outcome,
    PollingRelay,
    Upcasters,
    inbox_guard,
)
from mongo_outbox.consumers import consume_nats
from mongo_outbox.faststream import inbox_handler
from mongo_outbox.publishers import NatsPublisher
from tests.support.cli import cli
from tests.support.servers import NATS_URL, MongoServer
from tests.support.waiting import until

FAST = Backoff(initial=0.05, maximum=0.1)


class PlacedV1(BaseModel):
    order: str
    euros: int


class PlacedV2(BaseModel):
    event_version: ClassVar[int] = 2
    order: str
    cents: int


class PlacedV3(BaseModel):
    event_version: ClassVar[int] = 3
    order: str
    cents: int
    currency: str


def v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {"order": payload["order"], "cents": payload["euros"] * 100}


def v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    return payload | {"currency": "EUR"}


async def save(db: Any, payload: BaseModel) -> Event:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    order = payload.order  # type: ignore[attr-defined]
    event = Event.of(payload, type="order.placed")
    saved = await outbox.save_with_events(None, db.orders, {"_id": order}, [event])
    return saved.events[0]


async def relay(db: Any, unique: str) -> None:
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{unique}.{{type}}")
    try:
        assert await PollingRelay(Outbox(db), publisher).drain() > 0
    finally:
        await publisher.aclose()


def consumer(
    db: Any, name: str, model: type[BaseModel], upcasters: Upcasters, seen: list[Any]
) -> Any:
    """A guarded handler reading ``model``, writing one effect per message in the inbox's
    transaction; what it saw goes to ``seen``, what it dead-lettered to ``seen`` too."""

    async def dead_letter(event: Event, reason: str) -> None:
        seen.append(("dead", event, reason))

    @inbox_guard(
        Inbox(db, consumer=name, transactional=True),
        backoff=FAST,
        dead_letter=dead_letter,
        upcasters=upcasters,
    )
    async def handle(event: Event, session: Any) -> None:
        value = event.payload_as(model)
        seen.append(value)
        await db.effects.insert_one({"consumer": name, "event": event.id}, session=session)

    return handle


@contextlib.asynccontextmanager
async def running(js: Any, unique: str, durable: str, guarded: Any) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_nats(js, f"{unique}.>", durable, guarded, stream=unique, batch=1, stop=stop)
    )
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


def drained(js: Any, stream: str, durable: str) -> Callable[[], Awaitable[bool]]:
    async def every_message_settled() -> bool:
        try:
            info = await js.consumer_info(stream, durable)
        except NotFoundError:  # consume_nats has not created its durable yet
            return False
        return info.num_pending == 0 and info.num_ack_pending == 0

    return every_message_settled


async def effects(db: Any, name: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for doc in await db.effects.find({"consumer": name}).to_list(None):
        counts[doc["event"]] = counts.get(doc["event"], 0) + 1
    return counts


async def test_a_v1_event_reaches_a_v3_consumer_through_redelivery_and_replay_once(
    mongo: MongoServer, db: Any, nats_client: Any, unique: str
) -> None:
    js = nats_client.jetstream()
    # A short duplicate window: replays must reach the consumers, as they would after two
    # minutes with the default one.
    await js.add_stream(name=unique, subjects=[f"{unique}.>"], duplicate_window=0.1)
    where = [f"--uri={mongo.uri}", f"--db={db.name}"]
    replay = ["replay", *where, f"--nats={NATS_URL}", f"--subject={unique}.{{type}}", "--since=1h"]
    try:
        # An old producer publishes version 1.
        old = [await save(db, PlacedV1(order=f"o-{n}", euros=n)) for n in (1, 2)]
        assert [e.version for e in old] == [1, 1]
        await relay(db, unique)

        # Billing is deployed at version 3, its v1 -> v2 step forgotten: both are
        # dead-lettered at once (no retry reads them), their records keeping them as sent.
        seen: list[Any] = []
        forgot = Upcasters().register("order.placed", {2: v2_to_v3})
        async with running(js, unique, "billing", consumer(db, "billing", PlacedV3, forgot, seen)):
            await until(drained(js, unique, "billing"), 30)
        assert await effects(db, "billing") == {}
        assert [(s[0], s[1]) for s in seen] == [("dead", e) for e in old]
        assert all("no upcaster from v1" in s[2] for s in seen)
        failed = await Inbox(db, consumer="billing").failed()
        assert sorted(f["message_id"] for f in failed) == sorted(e.id for e in old)
        for record in failed:
            assert record["attempts"] == 1 and "IncompatibleEventError" in record["last_error"]
            assert Event.model_validate(record["event"]) in old  # nothing lost
        listed = await cli("inbox", "failed", *where, "--consumer=billing")
        assert [line.split()[3] for line in listed.out.splitlines()[1:]] == ["v1", "v1"]

        # The step is deployed; the operator requeues the dead letters and replays.
        dry = await cli(*replay, "--dry-run")
        assert ["order.placed", "v1", "2"] in [line.split() for line in dry.out.splitlines()]
        requeued = await cli(
            "inbox", "requeue", *where, "--consumer=billing", "--type=order.placed"
        )
        assert requeued.out.startswith("requeued 2 failed messages"), requeued.output
        seen.clear()
        full = Upcasters().register("order.placed", {1: v1_to_v2, 2: v2_to_v3})
        async with running(js, unique, "billing", consumer(db, "billing", PlacedV3, full, seen)):
            assert (await cli(*replay)).code == 0
            await until(drained(js, unique, "billing"), 30)
            # A new producer publishes version 3; then everything is replayed once more, and
            # the relay redelivers the v1 events (as after a crash before it marked them).
            new = await save(db, PlacedV3(order="o-3", cents=300, currency="USD"))
            await relay(db, unique)
            assert (await cli(*replay)).code == 0
            await asyncio.sleep(0.2)  # past the duplicate window of 0.1 s
            await db.outbox.update_many(
                {"_id": {"$in": [e.id for e in old]}},
                {
                    "$set": {
                        "status": "pending",
                        "available_at": datetime(2000, 1, 1, tzinfo=timezone.utc),
                    }
                },
            )
            await relay(db, unique)
            await until(drained(js, unique, "billing"), 30)
        # Every copy reached the stream: 2 relayed, 2 replayed, 1 relayed, 3 replayed, 2 again.
        assert (await js.stream_info(unique)).state.messages == 10
        assert await effects(db, "billing") == {e.id: 1 for e in [*old, new]}
        assert sorted(seen, key=lambda v: v.order) == [
            PlacedV3(order="o-1", cents=100, currency="EUR"),
            PlacedV3(order="o-2", cents=200, currency="EUR"),
            PlacedV3(order="o-3", cents=300, currency="USD"),
        ]
        assert await Inbox(db, consumer="billing").failed() == []

        # A mailer still at version 2 reads the v1 events, and refuses the v3 one clearly.
        mail: list[Any] = []
        v2_only = Upcasters().register("order.placed", {1: v1_to_v2})
        async with running(js, unique, "mailer", consumer(db, "mailer", PlacedV2, v2_only, mail)):
            await until(drained(js, unique, "mailer"), 30)
        assert await effects(db, "mailer") == {e.id: 1 for e in old}
        [dead] = [m for m in mail if isinstance(m, tuple)]
        assert dead[1] == new and "newer than the version 2 consumer mailer reads" in dead[2]
        [record] = await Inbox(db, consumer="mailer").failed()
        assert Event.model_validate(record["event"]) == new  # as sent: v3, its payload whole

        # The mailer is upgraded; its dead letter comes back through a requeue and a replay.
        requeued = await cli("inbox", "requeue", *where, "--consumer=mailer", "--all")
        assert requeued.out.startswith("requeued 1 failed messages"), requeued.output
        mail.clear()
        async with running(js, unique, "mailer", consumer(db, "mailer", PlacedV3, full, mail)):
            assert (await cli(*replay, "--type=order.placed")).code == 0
            await until(drained(js, unique, "mailer"), 30)
        assert await effects(db, "mailer") == {e.id: 1 for e in [*old, new]}
        assert mail == [PlacedV3(order="o-3", cents=300, currency="USD")]
    finally:
        await js.delete_stream(unique)


async def test_a_handler_reading_an_event_newer_than_its_model_dead_letters_it_at_once(
    db: Any,
) -> None:
    # No upcasters on the guard: the handler's own payload_as finds the event too new.
    event = Event.of(PlacedV3(order="o-9", cents=1, currency="EUR"), type="order.placed")
    inbox = Inbox(db, consumer="mailer", transactional=False)
    ran: list[int] = []

    @inbox_guard(inbox, max_attempts=5, backoff=FAST)
    async def too_old(event: Event, session: Any, *, attempt: int) -> None:
        ran.append(attempt)
        event.payload_as(PlacedV2)

    result = await too_old.handle(event)
    assert (result.outcome, result.attempt, ran) == (Outcome.DEAD_LETTERED, 1, [1])
    assert result.error is not None and result.error.startswith("IncompatibleEventError: ")
    assert "newer than the version 2 the model PlacedV2 reads" in result.error
    assert (await too_old.handle(event)).outcome is Outcome.DUPLICATE  # settled, not retried
    [record] = await inbox.failed()
    assert Event.model_validate(record["event"]) == event

    @inbox_guard(inbox, backoff=FAST)
    async def upgraded(event: Event, session: Any) -> None:
        ran.append(event.payload_as(PlacedV3).cents)

    assert await inbox.requeue([event.id]) == 1
    assert (await upgraded.handle(event)).outcome is Outcome.HANDLED
    assert ran == [1, 1]


async def test_a_faststream_subscriber_gets_the_payload_at_its_models_version(
    db: Any, nats_client: Any, unique: str
) -> None:
    js = nats_client.jetstream()
    await js.add_stream(name=unique, subjects=[f"{unique}.>"])
    try:
        old = await save(db, PlacedV1(order="o-1", euros=4))
        future = Event(type="order.placed", version=4, payload={"order": "o-2", "v4": True})
        await Outbox(db).save_with_events(None, db.orders, {"_id": "o-2"}, [future])
        await relay(db, unique)
        got: list[Any] = []
        full = Upcasters().register("order.placed", {1: v1_to_v2, 2: v2_to_v3})

        broker = NatsBroker(NATS_URL)

        @broker.subscriber(
            f"{unique}.>",
            stream=JStream(unique, declare=False),
            queue="billing",
            config=ConsumerConfig(ack_wait=30),
        )
        @inbox_handler(
            Inbox(db, consumer="billing", transactional=True),
            payload=PlacedV3,
            upcasters=full,
            backoff=FAST,
        )
        async def bill(placed: PlacedV3, session: Any) -> None:
            got.append(placed)

        async with broker:
            await broker.start()
            await until(drained(js, unique, "billing"), 30)
        assert got == [PlacedV3(order="o-1", cents=400, currency="EUR")]
        [record] = await Inbox(db, consumer="billing").failed()
        assert (
            record["message_id"] == future.id
            and "newer than the version 3" in (record["last_error"])
        )
        assert record["event"]["version"] == 4 and record["event"]["payload"]["v4"] is True
        assert old.version == 1
    finally:
        await js.delete_stream(unique)


async def test_inbox_handler_brings_an_event_to_its_models_version_not_past_it(db: Any) -> None:
    got: list[Any] = []
    full = Upcasters().register("order.placed", {1: v1_to_v2, 2: v2_to_v3})

    @inbox_handler(
        Inbox(db, consumer="mailer", transactional=False), payload=PlacedV2, upcasters=full
    )
    async def mail(placed: PlacedV2, session: Any) -> None:
        got.append(placed)

    guarded = mail.inbox.guarded  # type: ignore[attr-defined]
    v1 = Event(type="order.placed", payload={"order": "o-1", "euros": 2})
    assert (await guarded.handle(v1)).outcome is Outcome.HANDLED
    assert got == [PlacedV2(order="o-1", cents=200)]  # v2, though the chain goes on to v3
    v3 = Event.of(PlacedV3(order="o-2", cents=1, currency="EUR"), type="order.placed")
    result = await guarded.handle(v3)
    assert result.outcome is Outcome.DEAD_LETTERED and result.attempt == 1
    assert "newer than the version 2 the model PlacedV2 reads" in (result.error or "")


def test_the_guard_takes_an_upcasters_registry_and_nothing_else(db: Any) -> None:
    with pytest.raises(ConfigurationError) as refused:
        inbox_guard(Inbox(db, consumer="c"), upcasters={1: v1_to_v2})  # type: ignore[arg-type]
    assert refused.value.setting == "inbox_guard.upcasters"


def returns_a_list(payload: dict[str, Any]) -> Any:
    return [payload]


def raises(payload: dict[str, Any]) -> dict[str, Any]:
    return {"cents": payload["no such field"]}


def makes_no_event(payload: dict[str, Any]) -> dict[str, Any]:
    return {"order": payload["order"], "cents": float("nan")}  # no JSON number


def reader(kind: str, inbox: Inbox, upcasters: Upcasters, ran: list[Any]) -> Any:
    """The ``Guarded`` each way of reading a v1 event at v2 builds."""
    if kind == "inbox_guard":

        @inbox_guard(inbox, max_attempts=3, backoff=FAST, upcasters=upcasters)
        async def guarded(event: Event, session: Any) -> None:
            ran.append(event.payload_as(PlacedV2))

        return guarded

    @inbox_handler(
        inbox,
        max_attempts=3,
        backoff=FAST,
        upcasters=upcasters,
        payload=PlacedV2 if kind == "inbox_handler(payload=)" else None,
    )
    async def handler(placed: Any, session: Any) -> None:
        ran.append(placed)

    return handler.inbox.guarded  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("step", "error"),
    [
        (returns_a_list, "InvalidEventError: the upcaster of order.placed from v1 returned a list"),
        (raises, "KeyError: 'no such field'"),
        (makes_no_event, "InvalidEventError: the upcasters of order.placed from v1 to v2 made"),
    ],
    ids=["wrong-type", "raises", "no-event"],
)
@pytest.mark.parametrize("kind", ["inbox_guard", "inbox_handler(payload=)", "inbox_handler"])
async def test_a_failing_step_is_retried_then_dead_lettered_with_its_error_by_every_reader(
    db: Any, kind: str, step: Any, error: str
) -> None:
    # One rule, as for a handler that fails: inbox_handler(payload=Model) dead-lettered a
    # step's wrong type at once, without the error's class, where inbox_guard retried it.
    inbox = Inbox(db, consumer="billing", transactional=False)
    ran: list[Any] = []
    guarded = reader(kind, inbox, Upcasters().register("order.placed", {1: step}), ran)
    v1 = Event(type="order.placed", payload={"order": "o-1", "euros": 2})

    results = [await guarded.handle(v1) for _ in range(4)]

    assert [(r.outcome, r.attempt) for r in results] == [
        (Outcome.RETRY, 1),
        (Outcome.RETRY, 2),
        (Outcome.DEAD_LETTERED, 3),
        (Outcome.DUPLICATE, 3),  # the same message again: settled
    ]
    assert all(error in (r.error or "") for r in results[:3]), results
    assert ran == []
    [record] = await inbox.failed()
    assert error in record["last_error"] and record["event"]["version"] == 1


@pytest.mark.parametrize("arrived", [1, 2])
async def test_a_guard_whose_upcasters_go_past_the_handlers_model_says_so(
    db: Any, arrived: int
) -> None:
    # The dead letter said "is version 3, newer than version 2 ... deploy a reader that knows
    # it" of an event that arrived as v2 (or v1), which the record shows: no newer producer is
    # to blame, the consumer's own upcasters went past its model.
    full = Upcasters().register("order.placed", {1: v1_to_v2, 2: v2_to_v3})
    inbox = Inbox(db, consumer="billing", transactional=False)
    ran: list[int] = []

    @inbox_guard(inbox, backoff=FAST, upcasters=full)
    async def bill(event: Event, session: Any) -> None:
        ran.append(event.version)
        event.payload_as(PlacedV2)

    payloads = {1: {"order": "o-1", "euros": 2}, 2: {"order": "o-1", "cents": 200}}
    event = Event(type="order.placed", version=arrived, payload=payloads[arrived])
    results = await asyncio.gather(bill.handle(event), bill.handle(event))  # the same, twice

    [result] = [r for r in results if r.outcome is not Outcome.DUPLICATE]
    assert (result.outcome, result.attempt, ran) == (Outcome.DEAD_LETTERED, 1, [3])
    [record] = await inbox.failed()
    assert record["event"]["version"] == arrived
    assert record["last_error"] == (
        f"IncompatibleEventError: event {event.id} (order.placed) arrived as version {arrived}; "
        "consumer billing's upcasters brought it to version 3, past the version 2 the model "
        "PlacedV2 reads: the handler is behind its own upcasters (give the model PlacedV2 "
        "version 3, or pass the upcasters to payload_as instead of the guard: it upcasts to "
        "the model's version)"
    )
    assert "deploy a reader" not in record["last_error"]


async def test_a_guard_without_upcasters_still_blames_the_newer_event(db: Any) -> None:
    # What really happened there: the event came newer than the handler's model.
    @inbox_guard(Inbox(db, consumer="billing", transactional=False), backoff=FAST)
    async def bill(event: Event, session: Any) -> None:
        event.payload_as(PlacedV2)

    newer = Event.of(PlacedV3(order="o-1", cents=1, currency="EUR"), type="order.placed")
    result = await bill.handle(newer)
    assert result.outcome is Outcome.DEAD_LETTERED
    assert "is version 3, newer than the version 2 the model PlacedV2 reads" in (result.error or "")


def test_inbox_handler_refuses_a_model_with_a_class_version_when_decorated(db: Any) -> None:
    # Before any message: every one would have failed at payload_as.
    class Legacy(BaseModel):
        class_version: ClassVar[int] = 2
        order: str

    async def mail(placed: Legacy, session: Any) -> None:
        raise AssertionError("never runs")

    decorate = inbox_handler(Inbox(db, consumer="mailer"), payload=Legacy)
    with pytest.raises(ConfigurationError, match=r"Legacy\.class_version declares a version"):
        decorate(mail)
