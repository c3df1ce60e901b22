"""What the inbox and its guard accept: settings, handlers, message ids, clients' codec options,
and one handler per consumer name."""

from __future__ import annotations

import functools
import logging
from datetime import datetime, timedelta
from typing import Any

import pytest
from bson.codec_options import DatetimeConversion
from pymongo import AsyncMongoClient

from mongo_outbox import (
    Backoff,
    ConfigurationError,
    Event,
    Inbox,
    MessageIdentityError,
    OutboxError,
    Outcome,
    RetryLater,
    inbox_guard,
)
from tests.support.servers import MongoServer

MODES = [True, False]  # transactional, leased


def order_event(n: int = 1) -> Event:
    return Event(type="order.placed", payload={"total": n}, aggregate_type="orders", aggregate_id=n)


async def test_inbox_durations_are_seconds_or_a_timedelta(db: Any) -> None:
    inbox = Inbox(db, consumer="c", retention=3600, processing_lease=timedelta(seconds=30))
    assert inbox.retention == timedelta(hours=1)
    assert inbox.processing_lease == timedelta(seconds=30)
    assert Inbox(db, consumer="c", processing_lease=0.5).processing_lease == timedelta(seconds=0.5)


@pytest.mark.parametrize(
    ("settings", "setting"),
    [
        ({"retention": 0}, "Inbox.retention"),
        ({"retention": -1.0}, "Inbox.retention"),
        ({"retention": "30 days"}, "Inbox.retention"),
        ({"retention": timedelta.max}, "Inbox.retention"),
        ({"processing_lease": float("nan")}, "Inbox.processing_lease"),
        ({"processing_lease": float("inf")}, "Inbox.processing_lease"),
        ({"processing_lease": timedelta(0)}, "Inbox.processing_lease"),
        ({"processing_lease": True}, "Inbox.processing_lease"),
        # A claim that outlives its record would let a redelivery run beside its holder.
        (
            {"processing_lease": 60, "retention": 30, "transactional": False},
            "Inbox.processing_lease",
        ),
        ({"consumer": ""}, "Inbox.consumer"),
        ({"consumer": 7}, "Inbox.consumer"),
        ({"collection": ""}, "Inbox.collection"),
        ({"collection": "in$box"}, "Inbox.collection"),
        ({"collection": "inbox."}, "Inbox.collection"),
        ({"transactional": "yes"}, "Inbox.transactional"),
    ],
)
async def test_inbox_refuses_a_bad_setting_by_name(
    db: Any, settings: dict[str, Any], setting: str
) -> None:
    arguments: dict[str, Any] = {"consumer": "c"} | settings
    with pytest.raises(ConfigurationError) as caught:
        Inbox(db, **arguments)
    assert caught.value.setting == setting


@pytest.mark.parametrize("max_attempts", [0, -1, True, 2.5, "3"])
async def test_inbox_guard_refuses_a_bad_max_attempts(db: Any, max_attempts: Any) -> None:
    with pytest.raises(ConfigurationError) as caught:
        inbox_guard(Inbox(db, consumer="c"), max_attempts=max_attempts)
    assert caught.value.setting == "inbox_guard.max_attempts"


async def test_inbox_guard_refuses_what_is_not_a_backoff_or_an_inbox(db: Any) -> None:
    with pytest.raises(ConfigurationError) as caught:
        inbox_guard(Inbox(db, consumer="c"), backoff=0.5)  # type: ignore[arg-type]
    assert caught.value.setting == "inbox_guard.backoff"
    with pytest.raises(TypeError, match="needs an Inbox"):
        inbox_guard(db)


class SyncCallable:
    def __call__(self, event: Event, session: Any) -> None:
        pass


async def test_a_handler_that_is_not_async_is_refused_at_decoration(db: Any) -> None:
    inbox = Inbox(db, consumer="c", transactional=True)
    effects: list[str] = []

    def plain(event: Event, session: Any) -> None:
        effects.append(event.id)  # would run on every retry before the guard failed

    for handler in (plain, functools.partial(plain), SyncCallable(), SyncCallable, print):
        with pytest.raises(TypeError, match="async"):
            inbox_guard(inbox)(handler)  # type: ignore[arg-type]

    def dead_letter(event: Event, reason: str) -> None:
        pass

    with pytest.raises(TypeError, match="dead_letter"):
        inbox_guard(inbox, dead_letter=dead_letter)  # type: ignore[arg-type]
    assert effects == []
    assert await db.list_collection_names() == []


class AsyncCallable:
    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    async def __call__(self, event: Event, session: Any) -> None:
        self.seen.append(f"object {event.id}")

    async def method(self, event: Event, session: Any) -> None:
        self.seen.append(f"method {event.id}")


async def test_async_callables_of_every_shape_are_guarded(db: Any) -> None:
    seen: list[str] = []

    async def tagged(tag: str, event: Event, session: Any) -> None:
        seen.append(f"{tag} {event.id}")

    handlers = [
        AsyncCallable(seen),
        AsyncCallable(seen).method,
        functools.partial(tagged, "partial"),
        functools.partial(functools.partial(tagged), "nested"),
    ]
    events = [order_event(n) for n in range(len(handlers))]
    for n, (handler, event) in enumerate(zip(handlers, events, strict=True)):
        guarded = inbox_guard(Inbox(db, consumer=f"c{n}", transactional=True))(handler)
        assert await guarded(event) is True
        assert await guarded(event) is False
    assert seen == [
        f"object {events[0].id}",
        f"method {events[1].id}",
        f"partial {events[2].id}",
        f"nested {events[3].id}",
    ]


@pytest.mark.parametrize(
    "message_id", [0, 7, 7.0, b"m-1", ["m-1"], {"id": 1}, "", "x" * 513], ids=repr
)
@pytest.mark.parametrize("transactional", MODES)
async def test_a_message_id_that_is_not_a_non_empty_string_is_refused_before_any_write(
    db: Any, transactional: bool, message_id: Any
) -> None:
    runs: list[str] = []

    @inbox_guard(Inbox(db, consumer="c", transactional=transactional))
    async def handler(event: Event, session: Any) -> None:
        runs.append(event.id)

    with pytest.raises(MessageIdentityError) as caught:
        await handler.handle(order_event(), message_id=message_id)
    assert isinstance(caught.value, OutboxError)
    assert caught.value.message_id == message_id
    with pytest.raises(MessageIdentityError):  # "" is a source: the one of no aggregate type
        await handler.handle(order_event(), source=message_id if message_id != "" else 1)
    assert runs == []
    assert await db.list_collection_names() == []


async def test_a_numeric_looking_id_is_one_identity_only_as_a_string(db: Any) -> None:
    runs: list[str] = []

    @inbox_guard(Inbox(db, consumer="c", transactional=True))
    async def handler(event: Event, session: Any) -> None:
        runs.append(event.id)

    event = order_event()
    assert await handler(event, message_id="7") is True
    assert await handler(order_event(2), message_id="7") is False  # same id: a duplicate
    with pytest.raises(MessageIdentityError):
        await handler(event, message_id=7)  # type: ignore[arg-type]
    assert runs == [event.id]


@pytest.mark.parametrize("transactional", MODES)
async def test_the_inbox_ignores_how_the_client_decodes_dates(
    mongo: MongoServer, db: Any, transactional: bool
) -> None:
    """A client with ``datetime_conversion=DATETIME_MS`` (and naive datetimes) hands back
    ``DatetimeMS`` values: the inbox reads its records with codec options of its own."""
    client = AsyncMongoClient[Any](mongo.uri, datetime_conversion=DatetimeConversion.DATETIME_MS)
    theirs = client[db.name]
    inbox = Inbox(theirs, consumer="c", transactional=transactional, processing_lease=30)
    attempts: list[int] = []

    async def dead_letter(event: Event, reason: str) -> None:
        pass

    @inbox_guard(inbox, max_attempts=2, backoff=Backoff(initial=0.01), dead_letter=dead_letter)
    async def handler(event: Event, session: Any, *, attempt: int) -> None:
        attempts.append(attempt)
        raise ValueError("always broken")

    try:
        if not transactional:
            # A claim held elsewhere: its lease_until is read to tell the redelivery when.
            other = order_event(2)
            await theirs.inbox.insert_one(
                {"consumer": "c", "source": "orders", "message_id": other.id}
                | {"status": "processing", "attempts": 1, "token": "elsewhere"}
                | {"lease_until": datetime.now().astimezone() + timedelta(seconds=30)}
            )
            with pytest.raises(RetryLater) as caught:
                await handler(other)
            assert 25 < caught.value.delay <= 30
        event = order_event()
        assert (await handler.handle(event)).outcome is Outcome.RETRY
        assert (await handler.handle(event)).outcome is Outcome.DEAD_LETTERED
        [record] = await inbox.failed()
        assert isinstance(record["expire_at"], datetime) and record["expire_at"].tzinfo
        assert attempts == [1, 2]
    finally:
        await client.close()


async def test_two_handlers_under_one_consumer_name_are_warned_about(
    db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mongo_outbox")

    async def bill(event: Event, session: Any) -> None:
        pass

    async def ship(event: Event, session: Any) -> None:
        pass

    billing = inbox_guard(Inbox(db, consumer="billing", transactional=True))
    assert await billing(bill)(order_event(1))
    assert await billing(bill)(order_event(2))  # the same handler again, as a restart would
    assert not [r for r in caplog.records if "shared" in r.getMessage()]

    assert await billing(ship)(order_event(3))
    [warning] = [r for r in caplog.records if "shared" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    message = warning.getMessage()
    assert "'billing'" in message
    assert f"{__name__}.test_two_handlers_under_one_consumer_name_are_warned_about" in message
    assert ".<locals>.bill" in message and ".<locals>.ship" in message


@pytest.mark.parametrize(
    ("conflict", "said"),
    [
        (
            "ttl_of_another_name",
            "its index 'ttl' cannot be created: the index 'my_ttl' (on expire_at, "
            "expireAfterSeconds 3600) stands in its way: drop it, or use another "
            "Inbox.collection",
        ),
        (
            "identity_not_unique",
            "its index 'identity' cannot be created: the index 'identity' (on consumer) stands "
            "in its way",
        ),
        ("duplicates", "its index 'identity' cannot be created: records of one message identity"),
    ],
)
async def test_an_index_in_the_way_of_the_inbox_is_a_configuration_error_not_an_outage(
    db: Any, conflict: str, said: str
) -> None:
    # Retried as "inbox unavailable", it never counted an attempt and never stopped: every
    # delivery of every message came back for ever. No retry can fix it: it is refused, naming
    # the index in the way (the emulator's own message names only the keys).
    if conflict == "ttl_of_another_name":
        await db.inbox.create_index("expire_at", expireAfterSeconds=3600, name="my_ttl")
    elif conflict == "identity_not_unique":
        await db.inbox.create_index([("consumer", 1)], name="identity")
    else:
        record = {"consumer": "c", "source": None, "message_id": "m"}
        await db.inbox.insert_many([dict(record), dict(record)])
    inbox = Inbox(db, consumer="c", transactional=False)
    with pytest.raises(ConfigurationError) as caught:
        await inbox.ensure_indexes()
    assert said in str(caught.value)
    assert caught.value.setting == "Inbox.collection"
    runs: list[str] = []

    @inbox_guard(inbox)
    async def handler(event: Event, session: Any) -> None:
        runs.append(event.id)

    # Called, the guard keeps its promise never to raise for it: a retry at the longest delay,
    # not an attempt (the consumers refuse to start on it).
    with pytest.raises(RetryLater, match=r"its index .* cannot be created") as retried:
        await handler(Event(type="t"))
    assert (retried.value.attempt, retried.value.delay) == (0, 300.0)
    assert runs == []
