"""stop() with a slow but healthy broker: a relay ends its round before the next wave, not
after all of them (a round of 20 waves of 1 s confirms held a stop 15 s, past the CLI's 10 s
--stop-timeout). What the round did not publish is released, due at once, and published later
in order, once. ``SlowBroker`` (tests/support/relay_fakes.py) is a FAKE: confirms on demand."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mongo_outbox import ChangeStreamRelay, PollingRelay, RelayGroup, RelaySettings
from mongo_outbox.publishers import MemoryPublisher
from tests.support.changestream_sources import ScriptedSource
from tests.support.outboxes import MODES, assert_in_order, make_outbox, save_one_by_one
from tests.support.relay_fakes import SlowBroker

CONFIRM = 0.3  # a round of ten waves takes 3 s
AGGREGATES = 4  # a wave: one event of each


async def stop_in_time(relay: Any, broker: SlowBroker) -> None:
    """Run ``relay`` until its first wave is confirmed, stop it, and check that it published
    no further wave: once stopped, it waits for the confirms of the waves in flight only, one
    event of each aggregate at most.

    Counted, not timed: the stop also settles the round (and a member gives its leases back),
    round trips that take longer than a confirm on a loaded machine (0.6 to 2.0 s against a
    bound of 0.6 s, in a loaded CI run), while the waves it must not start are there to count.
    Counted from the stop, not from the first confirm: a loaded loop may run this test's task
    a wave or two after the confirm woke it (8 published by then, in a loaded run).
    """
    task = asyncio.create_task(relay.run())
    await broker.wait_for(1, timeout=10)
    before = len(broker.events)
    relay.stop()
    # Bounded only against a hang: a stop after every wave still ends within this.
    await asyncio.wait_for(task, 60)
    after = len(broker.events) - before
    assert after <= AGGREGATES, f"{after} published after the stop: a next wave"


@pytest.mark.parametrize("mode", MODES)
async def test_a_polling_relay_stops_before_the_next_wave(db: Any, mode: str) -> None:
    outbox = make_outbox(db, mode)
    saved = await save_one_by_one(outbox, db, aggregates=AGGREGATES, events=10)
    broker = SlowBroker(CONFIRM)
    await stop_in_time(PollingRelay(outbox, broker), broker)
    publisher = MemoryPublisher()
    await PollingRelay(outbox, publisher).drain()  # the rest is due at once
    assert_in_order(broker.events + publisher.events, saved, once=True)


async def test_a_change_stream_relay_stops_before_the_next_wave(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save_one_by_one(outbox, db, aggregates=AGGREGATES, events=10)
    broker = SlowBroker(CONFIRM)
    relay = ChangeStreamRelay(
        outbox, broker, name="r", source=ScriptedSource(), settings=RelaySettings(), max_wait=0.05
    )
    await stop_in_time(relay, broker)  # stopped during its first sweep
    publisher = MemoryPublisher()
    await PollingRelay(outbox, publisher).drain()
    assert_in_order(broker.events + publisher.events, saved, once=True)


async def test_a_relay_group_member_stops_before_the_next_wave(db: Any) -> None:
    outbox = make_outbox(db, "collection", partitions=2)
    saved = await save_one_by_one(outbox, db, aggregates=AGGREGATES, events=10)
    broker = SlowBroker(CONFIRM)
    member = RelayGroup(outbox, broker, interval=0.05)
    # Its partitions' rounds may each have a wave in flight: together one event per aggregate.
    await stop_in_time(member, broker)
    publisher = MemoryPublisher()
    await PollingRelay(outbox, publisher).drain()
    assert_in_order(broker.events + publisher.events, saved, once=True)
