"""Both relays report one RelayStatus: their state, the outbox's backlog and its parked entries."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from mongo_outbox import Backoff, ChangeStreamRelay, Event, Outbox, PollingRelay, RelaySettings
from mongo_outbox.publishers import MemoryPublisher
from tests.support.waiting import until

MODES = ["collection", "embedded"]


def make_outbox(db: Any, mode: str) -> Outbox:
    return Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]


async def save(outbox: Outbox, db: Any, n: int, event_type: str = "placed") -> list[Event]:
    events: list[Event] = []
    for i in range(n):
        saved = await outbox.save_with_events(
            None, db.orders, {"_id": f"{event_type}-{i}"}, [Event(type=event_type)]
        )
        events += saved.events
    return events


@pytest.mark.parametrize("mode", MODES)
async def test_a_polling_relay_reports_its_state_backlog_and_parked_entries(
    db: Any, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    await save(outbox, db, 3)
    await save(outbox, db, 1, "poison")
    publisher = MemoryPublisher(
        fail=lambda e: ValueError("cannot encode") if e.type == "poison" else None
    )
    relay = PollingRelay(
        outbox, publisher, name="pr", settings=RelaySettings(max_attempts=1), interval=0.05
    )

    before = await relay.status()
    assert (before.name, before.state, before.active) == ("pr", "starting", False)
    assert before.pending == 4 and before.parked == 0
    assert before.oldest_pending_age is not None and before.oldest_pending_age.total_seconds() >= 0
    assert before.last_checkpoint_at is None and before.recoveries == 0

    with caplog.at_level(logging.INFO, logger="mongo_outbox.relay"):
        task = asyncio.create_task(relay.run())

        async def settled() -> bool:
            status = await relay.status()
            return status.pending == 0 and status.parked == 1

        await until(settled)
        during = await relay.status()
        assert (during.state, during.active) == ("active", True)
        assert during.oldest_pending_age is None and during.publish_failures == 1
        assert during.last_error is not None and "cannot encode" in during.last_error
        relay.stop()
        await asyncio.wait_for(task, 5)
    after = await relay.status()
    assert (after.state, after.active) == ("stopped", False)
    changes = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
    assert changes == [
        "relay pr: starting -> active (run() started)",
        "relay pr: active -> stopped (stop() was called)",
    ]


async def test_a_cancelled_polling_relay_reports_itself_stopped(db: Any) -> None:
    relay = PollingRelay(make_outbox(db, "collection"), MemoryPublisher(), interval=0.05)
    assert relay.name == "polling-relay"
    task = asyncio.create_task(relay.run())
    await until(lambda: relay.state == "active")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    status = await relay.status()
    assert (status.state, status.active) == ("stopped", False)


@pytest.mark.parametrize("mode", MODES)
async def test_both_relays_report_the_same_outbox_alike(db: Any, mode: str) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    await save(outbox, db, 2)
    await save(outbox, db, 1, "poison")
    broken = MemoryPublisher(fail=lambda e: ValueError("no") if e.type == "poison" else None)
    await PollingRelay(outbox, broken, settings=RelaySettings(max_attempts=1)).drain()
    await save(outbox, db, 2, "later")

    polling = await PollingRelay(outbox, MemoryPublisher()).status()
    streaming = await ChangeStreamRelay(outbox, MemoryPublisher(), name="cs").status()
    for status in (polling, streaming):
        assert status.pending == 2 and status.parked == 1 and status.state == "starting"
    assert polling.oldest_pending_age and streaming.oldest_pending_age
    assert abs(polling.oldest_pending_age - streaming.oldest_pending_age).total_seconds() < 5


@pytest.mark.parametrize("mode", MODES)
async def test_both_relays_park_a_poison_event_after_ten_attempts_by_default(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    [poison] = await save(outbox, db, 1, "poison")
    broken = MemoryPublisher(fail=lambda e: ValueError("cannot encode"))
    fast = RelaySettings(backoff=Backoff(initial=0.001, maximum=0.001))  # max_attempts: default
    assert fast.max_attempts == RelaySettings().max_attempts == 10
    relay = PollingRelay(outbox, broken, settings=fast)
    assert ChangeStreamRelay(outbox, broken, name="cs").settings.max_attempts == 10
    assert PollingRelay(outbox, broken).settings.max_attempts == 10

    async def parked() -> bool:
        await relay.drain()
        return (await relay.status()).parked == 1

    await until(parked, timeout=20, every=0.01)
    [entry] = await relay.parked()
    assert entry["_id"] == poison.id and entry["attempts"] == 10
