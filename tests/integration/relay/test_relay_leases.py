"""Claim and leader leases under a slow broker: no event is published twice by two polling relays,
a slow round keeps its leader lease, a deleted checkpoint never leaves two change-stream relays
active for good, and a wave wider than the in-flight window never outlives its claim.

``SlowBroker`` (tests/support/relay_fakes.py) is a FAKE: a confirm that takes 0.4 s, on demand."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from mongo_outbox import (
    Backoff,
    ChangeStreamRelay,
    PollingRelay,
    RelaySettings,
)
from mongo_outbox.publishers import MemoryPublisher
from tests.support.changestream_sources import ScriptedSource
from tests.support.outboxes import assert_in_order, make_outbox, save_one_by_one
from tests.support.relay_fakes import SlowBroker
from tests.support.waiting import until

# Each waits out a lease behind a FAKE broker that confirms slowly: 4 to 9 s.
pytestmark = pytest.mark.slow

FAST = Backoff(initial=0.01, maximum=0.05)


async def test_a_slow_broker_never_lets_two_polling_relays_publish_an_event_twice(
    db: Any,
) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save_one_by_one(outbox, db, aggregates=1, events=12)
    broker = SlowBroker(0.4)  # 12 confirms in a row take 4.8 s; a claim holds 2 s
    settings = RelaySettings(claim_lease=2.0, publish_timeout=1.0, backoff=FAST)
    relays = [PollingRelay(outbox, broker, settings=settings, interval=0.05) for _ in range(2)]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    await broker.wait_for(len(saved), timeout=30)
    await asyncio.sleep(settings.claim_lease)  # a late duplicate would arrive by now
    for relay in relays:
        relay.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert_in_order(broker.events, saved, once=True)


async def test_a_slow_round_keeps_the_leader_lease_and_one_relay_active(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save_one_by_one(outbox, db, aggregates=2, events=15)
    broker = SlowBroker(0.3)  # the first sweep takes 4.5 s, the leader lease is 1 s
    settings = RelaySettings(claim_lease=2.0, publish_timeout=1.0, backoff=FAST)
    relays = [
        ChangeStreamRelay(
            outbox,
            broker,
            name="r",
            source=ScriptedSource(),
            settings=settings,
            leader_lease=1.0,
            sweep_interval=60,
        )
        for _ in range(2)
    ]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    both = samples = 0
    loop = asyncio.get_running_loop()
    most, since = 0, loop.time()
    while len(broker.events) < len(saved):
        samples += 1
        both += all(r.state == "active" for r in relays)
        for relay in relays:
            # Compared only when the state held while status() read the store: on a loaded
            # machine a renewal may fail during that read, and the relay step down meanwhile.
            before = relay.state
            active = (await relay.status()).active
            if relay.state == before:
                assert active == (before == "active")
        await asyncio.sleep(0.05)
        if len(broker.events) > most:
            most, since = len(broker.events), loop.time()
        # A stall, not a deadline: each publish takes 0.3 s however loaded the machine is.
        assert loop.time() - since < 20, f"nothing more published in 20 s, {most} in all"
    for relay in relays:
        relay.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert both == 0, f"both active in {both} of {samples} samples"
    assert_in_order(broker.events, saved, once=True)


async def test_a_deleted_checkpoint_never_leaves_two_relays_active_for_good(db: Any) -> None:
    outbox = make_outbox(db, "collection")
    # A lease of seconds: one of 0.6 s was given up in a loaded machine's half-second stall
    # (at eight tenths of it without a renewal), and for a moment no relay was active.
    lease = 3.0
    relays = [
        ChangeStreamRelay(
            outbox, MemoryPublisher(), name="r", source=ScriptedSource(), leader_lease=lease
        )
        for _ in range(2)
    ]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    await until(lambda: any(r.state == "active" for r in relays))
    for _ in range(2):  # deleted, then deleted again once someone recreated it
        await db.outbox_relays.delete_many({})
        await until(lambda: db.outbox_relays.count_documents({}))
        # The holder's renewal (every third of the lease) and a standby's poll (every quarter)
        # have passed: each saw the deletion.
        await asyncio.sleep(lease / 3 + lease / 4 + 0.25)
        for _ in range(20):
            assert sum(r.state == "active" for r in relays) == 1
            for relay in relays:
                assert (await relay.status()).active == (relay.state == "active")
            await asyncio.sleep(0.05)
    doc = await db.outbox_relays.find_one({"_id": "r"})
    [leader] = [r for r in relays if r.state == "active"]
    assert doc["owner"] == leader.checkpoint.owner
    for relay in relays:
        relay.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)


async def test_a_wave_wider_than_the_in_flight_window_never_outlives_its_claim(
    db: Any,
) -> None:
    outbox = make_outbox(db, "collection")
    saved = await save_one_by_one(outbox, db, aggregates=4, events=1)
    broker = SlowBroker(0.9)  # one at a time: the wave of four would take 3.6 s of a 2 s claim
    settings = RelaySettings(
        batch_size=4, max_in_flight=1, claim_lease=2.0, publish_timeout=1.0, backoff=FAST
    )
    relays = [PollingRelay(outbox, broker, settings=settings, interval=0.05) for _ in range(2)]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    await broker.wait_for(len(saved), timeout=30)
    await asyncio.sleep(2.0)  # a late duplicate would arrive by now
    for relay in relays:
        relay.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert_in_order(broker.events, saved, once=True)


async def test_a_take_over_whose_answer_was_lost_is_the_relays_again_at_once(db: Any) -> None:
    """A bounded take-over that the server applied but whose reply never came (the bound
    fired) leaves the lease to this relay under a fence it does not know. Its next attempt
    takes it again at once, with a new fence, rather than waiting a lease for its own to run
    out, while another relay still cannot take it."""
    from mongo_outbox._relay.lease import FencedLease

    lease = timedelta(seconds=60)
    mine = FencedLease(db.outbox_relays, "orders", lease)
    other = FencedLease(db.outbox_relays, "orders", lease)
    assert await mine.acquire()
    lost = mine.fence
    mine.fence = None  # what a bound that fired after the server applied it leaves
    assert not await other.acquire()
    assert await mine.acquire()
    assert mine.fence is not None and lost is not None and mine.fence > lost
    assert not await other.acquire()
