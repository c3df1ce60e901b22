"""Every constructor (and consumer) refuses a bad setting the same way: a ``ConfigurationError``
(a ``ValueError`` too, for callers that catch those) whose ``setting`` names the parameter, and
whose message says which, before anything is connected to or written."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient

from mongo_outbox import (
    Backoff,
    ChangeStreamRelay,
    ConfigurationError,
    Inbox,
    Outbox,
    PollingRelay,
    RelayGroup,
    RelaySettings,
    inbox_guard,
)
from mongo_outbox import sync as sync_api
from mongo_outbox.consumers import consume_nats, consume_rabbitmq, consume_redis
from mongo_outbox.publishers import (
    MemoryPublisher,
    NatsPublisher,
    RabbitMQPublisher,
    RedisStreamsPublisher,
)

# Clients that never connect: a constructor that sent a command would fail on a closed port.
ASYNC_DB: Any = AsyncMongoClient[Any]("mongodb://127.0.0.1:9", connect=False).shop
SYNC_DB: Any = MongoClient[Any]("mongodb://127.0.0.1:9", connect=False).shop


def outbox(**options: Any) -> Outbox:
    return Outbox(ASYNC_DB, **options)


async def handler(event: Any, session: Any) -> None:
    pass


def guarded() -> Any:
    return inbox_guard(Inbox(ASYNC_DB, consumer="c"))(handler)


Build = Callable[[Any], Any]

# (setting, how to build with the bad value, bad values)
CASES: list[tuple[str, Build, list[Any]]] = [
    ("Outbox.mode", lambda v: outbox(mode=v), ["inline", None]),
    ("Outbox.collections", lambda v: outbox(mode="embedded", collections=v), [(), []]),
    ("Outbox.retention", lambda v: outbox(retention=v), [0, -1, timedelta(0), "7d"]),
    ("Outbox.collection", lambda v: outbox(collection=v), ["", None, "a\x00b"]),
    ("Outbox.field", lambda v: outbox(mode="embedded", collections=["o"], field=v), ["a.b"]),
    ("Outbox.partitions", lambda v: outbox(partitions=v), [0, 1.5, True]),
    ("Outbox.aggregate_types", lambda v: outbox(aggregate_types=v), [["o"], {"o": ""}]),
    ("Outbox.mode", lambda v: sync_api.Outbox(SYNC_DB, mode=v), ["inline"]),
    ("Outbox.retention", lambda v: sync_api.Outbox(SYNC_DB, retention=v), [-3]),
    ("Outbox.collections", lambda v: sync_api.Outbox(SYNC_DB, mode="embedded"), [None]),
    ("RelaySettings.batch_size", lambda v: RelaySettings(batch_size=v), [0, 2.0]),
    ("RelaySettings.max_in_flight", lambda v: RelaySettings(max_in_flight=v), [0]),
    ("RelaySettings.publish_timeout", lambda v: RelaySettings(publish_timeout=v), [0, "1"]),
    ("RelaySettings.claim_lease", lambda v: RelaySettings(claim_lease=v), [1, -1]),
    ("RelaySettings.max_attempts", lambda v: RelaySettings(max_attempts=v), [0, False]),
    ("RelaySettings.backoff", lambda v: RelaySettings(backoff=v), [None, 0.5]),
    ("Backoff.factor", lambda v: Backoff(factor=v), [0.5, True]),
    ("Backoff.initial", lambda v: Backoff(initial=v, maximum=1), [0, 5]),
    (
        "PollingRelay.settings",
        lambda v: PollingRelay(outbox(), MemoryPublisher(), settings=v),
        [object(), {"batch_size": 5}],
    ),
    ("PollingRelay.interval", lambda v: PollingRelay(outbox(), MemoryPublisher(), interval=v), [0]),
    ("PollingRelay.name", lambda v: PollingRelay(outbox(), MemoryPublisher(), name=v), ["", 7]),
    (
        "ChangeStreamRelay.settings",
        lambda v: ChangeStreamRelay(outbox(), MemoryPublisher(), name="r", settings=v),
        [object()],
    ),
    (
        "ChangeStreamRelay.partition",
        lambda v: ChangeStreamRelay(outbox(partitions=4), MemoryPublisher(), name="r", partition=v),
        [-1, 4, True, "1"],
    ),
    (
        "ChangeStreamRelay.checkpoints",
        lambda v: ChangeStreamRelay(
            outbox(collections=["orders"]), MemoryPublisher(), name="r", checkpoints=v
        ),
        # Its records would overwrite the outbox's documents or an aggregate.
        ["", None, "outbox", "outbox_config", "outbox_event_ids", "orders"],
    ),
    (
        "ChangeStreamRelay.leader_lease",
        lambda v: ChangeStreamRelay(outbox(), MemoryPublisher(), name="r", leader_lease=v),
        [0, None],
    ),
    (
        "ChangeStreamRelay.name",
        lambda v: ChangeStreamRelay(outbox(), MemoryPublisher(), name=v),
        [""],
    ),
    ("RelayGroup.source", lambda v: RelayGroup(outbox(), MemoryPublisher(), source=v), ["kafka"]),
    ("RelayGroup.name", lambda v: RelayGroup(outbox(), MemoryPublisher(), name=v), [""]),
    (
        # At least 2.5 times the default publish_timeout of 10 s.
        "RelayGroup.member_lease",
        lambda v: RelayGroup(outbox(), MemoryPublisher(), member_lease=v),
        [0, 24.9, timedelta(seconds=10)],
    ),
    ("RelayGroup.settings", lambda v: RelayGroup(outbox(), MemoryPublisher(), settings=v), [1]),
    ("RelayGroup.interval", lambda v: RelayGroup(outbox(), MemoryPublisher(), interval=v), [-1]),
    (
        "RelayGroup.checkpoints",
        lambda v: RelayGroup(outbox(collections=["orders"]), MemoryPublisher(), checkpoints=v),
        ["", "outbox", "orders"],
    ),
    (
        "RelayGroup.members",
        lambda v: RelayGroup(outbox(collections=["orders"]), MemoryPublisher(), members=v),
        ["", "outbox_event_ids", "orders"],
    ),
    ("Inbox.consumer", lambda v: Inbox(ASYNC_DB, consumer=v), ["", None]),
    ("Inbox.collection", lambda v: Inbox(ASYNC_DB, consumer="c", collection=v), [""]),
    ("Inbox.transactional", lambda v: Inbox(ASYNC_DB, consumer="c", transactional=v), ["yes"]),
    ("Inbox.retention", lambda v: Inbox(ASYNC_DB, consumer="c", retention=v), [0]),
    (
        "Inbox.processing_lease",
        lambda v: Inbox(ASYNC_DB, consumer="c", transactional=False, processing_lease=v),
        [0, timedelta(days=30)],
    ),
    (
        "inbox_guard.max_attempts",
        lambda v: inbox_guard(Inbox(ASYNC_DB, consumer="c"), max_attempts=v),
        [0],
    ),
    ("NatsPublisher.timeout", lambda v: NatsPublisher(None, timeout=v), [0, "5"]),  # type: ignore[arg-type]
    ("RabbitMQPublisher.timeout", lambda v: RabbitMQPublisher(None, timeout=v), [-1]),  # type: ignore[arg-type]
    ("RedisStreamsPublisher.maxlen", lambda v: RedisStreamsPublisher(None, maxlen=v), [0]),  # type: ignore[arg-type]
    ("RedisStreamsPublisher.timeout", lambda v: RedisStreamsPublisher(None, timeout=v), [0]),  # type: ignore[arg-type]
]

ASYNC_CASES: list[tuple[str, Build, list[Any]]] = [
    ("consume_nats.batch", lambda v: consume_nats(None, "s", "d", guarded(), batch=v), [0]),  # type: ignore[arg-type]
    ("consume_nats.subject", lambda v: consume_nats(None, v, "d", guarded()), [""]),  # type: ignore[arg-type]
    (
        "consume_redis.claim_idle",
        lambda v: consume_redis(None, "s", "g", guarded(), claim_idle=v),  # type: ignore[arg-type]
        [0, "30"],
    ),
    ("consume_redis.batch", lambda v: consume_redis(None, "s", "g", guarded(), batch=v), [0]),  # type: ignore[arg-type]
    (
        "consume_rabbitmq.source",
        lambda v: consume_rabbitmq(None, guarded(), source=v),  # type: ignore[arg-type]
        [7, "x" * 1000],
    ),
    (
        "consume_rabbitmq.delivery_limit",
        lambda v: consume_rabbitmq(None, guarded(), delivery_limit=v),  # type: ignore[arg-type]
        [-1],
    ),
]


def _cases(cases: list[tuple[str, Build, list[Any]]]) -> list[Any]:
    return [
        pytest.param(setting, build, value, id=f"{setting}={_shown(value)}")
        for setting, build, values in cases
        for value in values
    ]


def _shown(value: Any) -> str:
    """The value in a test's id: the same in every process (a worker of `pytest -n` must
    collect the same ids), so no address of an object."""
    return repr(value) if type(value).__repr__ is not object.__repr__ else type(value).__name__


def assert_names(raised: pytest.ExceptionInfo[ConfigurationError], setting: str) -> None:
    assert raised.value.setting == setting
    assert isinstance(raised.value, ValueError)  # ``except ValueError`` still catches it
    parameter = setting.rsplit(".", 1)[1]
    assert parameter in str(raised.value), str(raised.value)


@pytest.mark.parametrize(("setting", "build", "value"), _cases(CASES))
def test_a_constructor_refuses_a_bad_setting_naming_it(
    setting: str, build: Build, value: Any
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        build(value)
    assert_names(raised, setting)


@pytest.mark.parametrize(("setting", "build", "value"), _cases(ASYNC_CASES))
async def test_a_consumer_refuses_a_bad_setting_before_it_reads(
    setting: str, build: Build, value: Any
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        await build(value)
    assert_names(raised, setting)


def test_an_outbox_reads_its_collections_once_so_an_iterator_is_no_empty_list() -> None:
    """The embedded layout and the relay both read ``collections``: an iterator read twice would
    leave the relay scanning nothing while saves still write events."""
    embedded = outbox(mode="embedded", collections=iter(["orders", "carts"]))
    assert embedded.collections == ("orders", "carts")
    assert sync_api.Outbox(SYNC_DB, mode="embedded", collections=iter(["orders"])).collections == (
        "orders",
    )
