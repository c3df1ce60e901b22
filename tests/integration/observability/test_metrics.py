"""``mongo_outbox.metrics`` recorded into the OpenTelemetry SDK's ``InMemoryMetricReader``, from
real relays and a real inbox guard against the test MongoDB; and nothing at all without an SDK,
or without OpenTelemetry installed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from mongo_outbox import (
    Backoff,
    BrokerFullError,
    BrokerUnavailableError,
    ChangeStreamRelay,
    Event,
    Inbox,
    InvalidEventError,
    Outbox,
    PoisonMessage,
    PollingRelay,
    RelayGroup,
    RelaySettings,
    RelayStatus,
    inbox_guard,
    metrics,
)
from mongo_outbox.publishers import MemoryPublisher
from mongo_outbox.tenants import TenantRelays
from tests.support.metrics import at, mine, points
from tests.support.servers import MongoServer
from tests.support.waiting import until

pytest.importorskip("opentelemetry.sdk.metrics", reason="the otel SDK comes with the dev extras")

FAST = Backoff(initial=0.01, maximum=0.02)


@pytest.fixture
def reader() -> Iterator[Any]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.use(provider)
    yield reader
    metrics.use(None)
    provider.shutdown()


@pytest.fixture
def quick_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "REFRESH_EVERY", 0.05)


class CountingRelay(PollingRelay):
    """A real PollingRelay that counts its status() calls (the gauges' only reads)."""

    status_calls = 0

    async def status(self) -> RelayStatus:
        self.status_calls += 1
        return await super().status()


async def save(outbox: Outbox, db: Any, *types: str) -> list[Event]:
    events: list[Event] = []
    for n, kind in enumerate(types):
        saved = await outbox.save_with_events(
            None, db.orders, {"_id": f"o-{n}"}, [Event(type=kind)]
        )
        events += saved.events
    return events


@pytest.mark.parametrize("transactional", [True, False])
async def test_inbox_outcomes_and_handler_durations_are_counted(
    db: Any, reader: Any, transactional: bool
) -> None:
    inbox = Inbox(db, consumer="billing", transactional=transactional)
    await inbox.ensure_indexes()
    runs: list[str] = []

    @inbox_guard(inbox, backoff=FAST)
    async def bill(event: Event, session: Any) -> None:
        runs.append(event.type)
        if event.type == "poison":
            raise PoisonMessage("no customer")
        if runs.count(event.type) == 1:
            raise RuntimeError("billing service down")  # the first run fails: a retry

    placed = Event(type="placed", aggregate_type="orders", aggregate_id="o-1")
    poison = Event(type="poison", aggregate_type="orders", aggregate_id="o-2")
    outcomes = [(await bill.handle(e)).outcome.value for e in (placed, placed, placed, poison)]
    assert outcomes == ["retry", "handled", "duplicate", "dead_lettered"]

    counted = points(reader, "mongo_outbox_inbox_messages")
    assert counted == {
        at(consumer="billing", outcome=outcome): 1
        for outcome in ("handled", "duplicate", "retry", "dead_lettered")
    }
    [(count, total)] = points(reader, "mongo_outbox_handler_duration").values()
    assert count == len(runs) == 3  # the failed run, the one that handled it, the poison
    assert 0 < total < 30


async def test_counters_exist_at_zero_before_their_first_count(db: Any, reader: Any) -> None:
    # Prometheus' increase() reads a series that first appears at 1 as no increase: the first
    # dead letter (or parked event) of a process went unseen by the kit's alerts.
    from mongo_outbox._inbox.outcomes import Outcome

    assert tuple(outcome.value for outcome in Outcome) == metrics.INBOX_OUTCOMES
    inbox = Inbox(db, consumer="billing", transactional=False)

    @inbox_guard(inbox)
    async def bill(event: Event, session: Any) -> None:
        raise PoisonMessage("no customer")

    assert points(reader, "mongo_outbox_inbox_messages") == {
        at(consumer="billing", outcome=outcome): 0 for outcome in metrics.INBOX_OUTCOMES
    }
    relay = PollingRelay(Outbox(db), MemoryPublisher(), name="orders-relay")
    task = asyncio.create_task(relay.run())
    await until(lambda: relay.state == "active")
    relay.stop()
    await asyncio.wait_for(task, 10)
    assert mine(points(reader, "mongo_outbox_publish_failures"), "orders-relay") == {
        at(database=db.name, relay="orders-relay", reason=reason): 0
        for reason in metrics.FAILURE_REASONS
    }
    assert mine(points(reader, "mongo_outbox_published"), "orders-relay") == {
        at(database=db.name, relay="orders-relay"): 0
    }


async def test_a_consumers_dead_letters_are_a_gauge_read_from_its_inbox(
    db: Any, reader: Any, quick_refresh: None
) -> None:
    # A counter of dead letters cannot raise an alert on a consumer's first one (its series
    # may first be scraped at 1: no increase) nor keep it up while the message stays dead.
    guards = {}
    for consumer in ("billing", "shipping"):  # two consumers, one process
        inbox = Inbox(db, consumer=consumer, transactional=False)

        @inbox_guard(inbox)
        async def handler(event: Event, session: Any) -> None:
            raise PoisonMessage("no customer")

        guards[consumer] = handler
        await handler.prepare()  # as a consumer does before its first delivery

    def dead(consumer: str) -> Any:
        return points(reader, "mongo_outbox_inbox_dead_letters").get(
            at(consumer=consumer, database=db.name)
        )

    # Read at the start, before any delivery: both there at 0.
    assert (dead("billing"), dead("shipping")) == (0, 0)
    first = Event(type="paid", aggregate_type="orders", aggregate_id="o-1")
    assert (await guards["billing"].handle(first)).outcome.value == "dead_lettered"
    await until(lambda: dead("billing") == 1, timeout=10, every=0.01)
    assert dead("shipping") == 0

    # Another process of billing (another guard, another Inbox object) dead-letters a second:
    # this one's count follows at its next refresh, read from the inbox.
    other = Inbox(db, consumer="billing", transactional=False)

    @inbox_guard(other)
    async def elsewhere(event: Event, session: Any) -> None:
        raise PoisonMessage("no customer")

    second = Event(type="paid", aggregate_type="orders", aggregate_id="o-2")
    assert (await elsewhere.handle(second)).outcome.value == "dead_lettered"
    await until(lambda: dead("billing") == 2, timeout=10, every=0.01)
    # A requeue (from a shell, say) takes it down; what stays dead-lettered stays counted.
    assert await other.requeue([first.id]) == 1
    await until(lambda: dead("billing") == 1, timeout=10, every=0.01)
    await asyncio.sleep(0.3)  # refreshes go on: it stays at 1
    assert (dead("billing"), dead("shipping")) == (1, 0)


async def test_publish_failures_are_counted_by_reason_and_publishes_per_relay(
    db: Any, reader: Any
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    failures = {
        "invalid": lambda e: InvalidEventError("over the broker's limit", event_id=e.id),
        "down": lambda e: BrokerUnavailableError("connection lost", event_id=e.id),
        "full": lambda e: BrokerFullError("stream full", event_id=e.id),
        "nowhere": lambda e: BrokerUnavailableError(
            "no stream", event_id=e.id, destination="orders.nowhere"
        ),
        "refused": lambda e: ValueError("refused"),
    }
    await save(outbox, db, "ok", *failures, "ok")
    publisher = MemoryPublisher(fail=lambda e: failures[e.type](e) if e.type in failures else None)
    relay = PollingRelay(outbox, publisher, name="orders-relay")
    published, _ = await relay.publish_batch()  # one round: each failure happens once
    assert published == 2

    assert points(reader, "mongo_outbox_publish_failures") == {
        at(database=db.name, relay="orders-relay", reason=reason): 1
        for reason in metrics.FAILURE_REASONS
    }
    assert points(reader, "mongo_outbox_published") == {
        at(database=db.name, relay="orders-relay"): 2
    }
    assert relay.stats.failed == 5  # the counters and the stats agree


async def test_a_running_relays_gauges_follow_its_backlog_and_state(
    db: Any, reader: Any, quick_refresh: None
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await save(outbox, db, "waits", "waits", "invalid")

    def fail(event: Event) -> Exception:
        if event.type == "invalid":
            return InvalidEventError("over the broker's limit", event_id=event.id)
        return BrokerUnavailableError("connection lost", event_id=event.id)

    relay = CountingRelay(outbox, MemoryPublisher(fail=fail), name="gauged", interval=0.05)
    assert mine(points(reader, "mongo_outbox_relay_state"), "gauged") == {}  # never ran yet
    task = asyncio.ensure_future(relay.run())
    try:

        def backlog() -> tuple[Any, ...]:
            pending = points(reader, "mongo_outbox_pending_events")
            parked = points(reader, "mongo_outbox_parked_events")
            return pending.get(at(database=db.name, relay="gauged")), parked.get(
                at(database=db.name, relay="gauged")
            )

        await until(lambda: backlog() == (2, 1), timeout=20, every=0.05)
        age = points(reader, "mongo_outbox_oldest_pending_age")[
            at(database=db.name, relay="gauged")
        ]
        assert 0 < age < 60
        assert (
            points(reader, "mongo_outbox_relay_active")[at(database=db.name, relay="gauged")] == 1
        )
        states = mine(points(reader, "mongo_outbox_relay_state"), "gauged")
        assert {dict(k)["state"]: v for k, v in states.items()} == {
            "starting": 0,
            "standby": 0,
            "active": 1,
            "stopped": 0,
            "failed": 0,
        }
        lags = points(reader, "mongo_outbox_checkpoint_lag")
        assert mine(lags, "gauged") == {}  # a polling relay keeps no checkpoint
        assert relay.status_calls > 0
    finally:
        relay.stop()
        await asyncio.wait_for(task, 20)
    assert points(reader, "mongo_outbox_relay_active")[at(database=db.name, relay="gauged")] == 0
    assert (
        points(reader, "mongo_outbox_relay_state")[
            at(database=db.name, relay="gauged", state="stopped")
        ]
        == 1
    )
    # A stopped relay reports no backlog.
    assert mine(points(reader, "mongo_outbox_pending_events"), "gauged") == {}


async def test_change_stream_relays_report_leadership_checkpoint_lag_and_recoveries(
    db: Any, reader: Any, quick_refresh: None
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await save(outbox, db, "placed", "placed", "placed")  # before the relays start: swept
    publisher = MemoryPublisher()
    leader = ChangeStreamRelay(outbox, publisher, name="streamer", leader_lease=2.0)
    standby = ChangeStreamRelay(outbox, MemoryPublisher(), name="streamer", leader_lease=2.0)
    first = asyncio.ensure_future(leader.run())
    await until(lambda: leader.state == "active", timeout=20)
    second = asyncio.ensure_future(standby.run())
    try:
        await until(lambda: standby.state == "standby", timeout=20)

        def reported() -> bool:
            lag = points(reader, "mongo_outbox_checkpoint_lag").get(
                at(database=db.name, relay="streamer")
            )
            pending = points(reader, "mongo_outbox_pending_events")
            return lag is not None and pending.get(at(database=db.name, relay="streamer")) == 0

        await until(reported, timeout=20, every=0.05)
        lag = points(reader, "mongo_outbox_checkpoint_lag")[at(database=db.name, relay="streamer")]
        assert 0 <= lag < 30
        # Two relay objects of one name in this process: one leads, one stands by.
        assert (
            points(reader, "mongo_outbox_relay_active")[at(database=db.name, relay="streamer")] == 1
        )
        states = points(reader, "mongo_outbox_relay_state")
        assert states[at(database=db.name, relay="streamer", state="active")] == 1
        assert states[at(database=db.name, relay="streamer", state="standby")] == 1
        assert points(reader, "mongo_outbox_published") == {
            at(database=db.name, relay="streamer"): 3
        }
        assert len(publisher.events) == 3
        # Its first start found no checkpoint: it swept, then watched, and lost nothing, so
        # that is no recovery; the counter is there at 0, so a first recovery is an increase.
        assert points(reader, "mongo_outbox_relay_recoveries") == {
            at(database=db.name, relay="streamer"): 0
        }
        assert (await leader.status()).recoveries == 0
    finally:
        leader.stop()
        standby.stop()
        await asyncio.wait_for(asyncio.gather(first, second), 30)


async def test_a_polling_group_reports_each_partition_it_publishes(
    db: Any, reader: Any, quick_refresh: None
) -> None:
    """A polling member reports its partitions as a change-stream member does (``GROUP/K``,
    with the partition label): their state, backlog and publishes, so that the alert on a
    partition without an owner sees polling groups too."""
    outbox = Outbox(db, partitions=2)
    await outbox.ensure_indexes()
    await save(outbox, db, "placed", "placed", "placed", "placed")
    publisher = MemoryPublisher()
    member = RelayGroup(
        outbox,
        publisher,
        name="pgroup",
        source="polling",
        member_lease=3.0,
        interval=0.05,
        settings=RelaySettings(claim_lease=2.0, publish_timeout=0.5),
    )
    task = asyncio.ensure_future(member.run())
    partitions = [at(database=db.name, relay=f"pgroup/{k}", partition=str(k)) for k in (0, 1)]
    try:

        def reported() -> bool:
            active = points(reader, "mongo_outbox_relay_active")
            pending = points(reader, "mongo_outbox_pending_events")
            return len(publisher.events) == 4 and all(
                active.get(labels) == 1 and pending.get(labels) == 0 for labels in partitions
            )

        await until(reported, timeout=20, every=0.05)
        published = points(reader, "mongo_outbox_published")
        assert sum(published.get(labels, 0) for labels in partitions) == 4
    finally:
        member.stop()
        await asyncio.wait_for(task, 30)
    # Stopped, the member publishes no partition: none is reported active any more.
    active = points(reader, "mongo_outbox_relay_active")
    assert all(active.get(labels, 0) == 0 for labels in partitions)


async def test_relays_of_one_name_in_several_databases_are_told_apart(
    client: Any, db: Any, reader: Any, quick_refresh: None
) -> None:
    other = client[f"{db.name}_b"]
    outboxes = [Outbox(db), Outbox(other)]
    for outbox, pending in zip(outboxes, (1, 3), strict=True):
        await outbox.ensure_indexes()
        await save(outbox, outbox.db, *["waits"] * pending)

    def fail(event: Event) -> Exception:
        return BrokerUnavailableError("connection lost", event_id=event.id)

    tenants = TenantRelays(
        [
            PollingRelay(o, MemoryPublisher(fail=fail), name="tenant", interval=0.05)
            for o in outboxes
        ]
    )
    task = asyncio.ensure_future(tenants.run())
    try:

        def backlogs() -> dict[str, Any]:
            found = mine(points(reader, "mongo_outbox_pending_events"), "tenant")
            return {dict(key)["database"]: value for key, value in found.items()}

        def failed_in() -> set[str]:
            failures = mine(points(reader, "mongo_outbox_publish_failures"), "tenant")
            return {dict(key)["database"] for key in failures}

        # The backlog gauge can be read before either relay's first publish has failed.
        await until(lambda: backlogs() == {db.name: 1, other.name: 3}, timeout=20, every=0.05)
        await until(lambda: failed_in() == {db.name, other.name}, timeout=20, every=0.05)
    finally:
        tenants.stop()
        await asyncio.wait_for(task, 20)
        await client.drop_database(other.name)


async def test_without_a_metrics_sdk_nothing_is_recorded_and_no_status_is_read(
    db: Any, quick_refresh: None
) -> None:
    from opentelemetry.metrics import get_meter_provider
    from opentelemetry.sdk.metrics import MeterProvider

    assert not isinstance(get_meter_provider(), MeterProvider)  # no SDK in this process
    metrics.use(None)
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await save(outbox, db, "placed", "placed")
    publisher = MemoryPublisher()
    relay = CountingRelay(outbox, publisher, name="unobserved", interval=0.05)
    task = asyncio.ensure_future(relay.run())
    try:
        await until(lambda: len(publisher.events) == 2, timeout=20)
        await asyncio.sleep(0.5)  # ten refresh periods: none may happen unobserved
    finally:
        relay.stop()
        await asyncio.wait_for(task, 20)
    assert relay.status_calls == 0
    inbox = Inbox(db, consumer="billing")

    @inbox_guard(inbox)
    async def bill(event: Event, session: Any) -> None:
        pass

    assert await bill(publisher.events[0]) is True


NO_OPENTELEMETRY = """
import asyncio, sys
sys.modules["opentelemetry"] = None  # as if the otel extra were not installed: imports fail

from pymongo import AsyncMongoClient
from mongo_outbox import ConfigurationError, Event, Inbox, Outbox, PollingRelay, inbox_guard
from mongo_outbox import metrics
from mongo_outbox.publishers import MemoryPublisher

async def main(uri, name):
    client = AsyncMongoClient(uri, tz_aware=True)
    db = client[name]
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await outbox.save_with_events(None, db.orders, {"_id": "o-1"}, [Event(type="placed")])
    relay = PollingRelay(outbox, MemoryPublisher(), interval=0.05)
    task = asyncio.ensure_future(relay.run())
    while relay.stats.published < 1:
        await asyncio.sleep(0.05)
    relay.stop()
    await task

    @inbox_guard(Inbox(db, consumer="billing"))
    async def bill(event, session):
        pass

    assert (await bill.handle(Event(type="placed"))).outcome.value == "handled"
    try:
        metrics.use(object())
    except ConfigurationError as error:
        print("use refused:", error)
    await client.drop_database(name)
    await client.close()
    print("relayed and handled")

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_the_library_runs_without_opentelemetry_installed(mongo: MongoServer, unique: str) -> None:
    ran = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(NO_OPENTELEMETRY), mongo.uri, unique],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert ran.returncode == 0, ran.stderr
    assert "relayed and handled" in ran.stdout
    assert "use refused: metrics need OpenTelemetry: pip install 'mongo-outbox[otel]'" in ran.stdout


def test_importing_the_library_does_not_import_the_metrics_api_or_an_sdk() -> None:
    # The trace API is imported with the library (mongo_outbox.tracing stamps every save); the
    # metrics API waits for the first instrument, and no SDK is ever imported by the library.
    check = (
        "import sys, mongo_outbox, mongo_outbox.metrics; "
        "print(sorted(m for m in sys.modules if m.startswith("
        "('opentelemetry.metrics', 'opentelemetry.sdk'))))"
    )
    ran = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]"
