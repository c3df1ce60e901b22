"""What the relay says during a broker outage matches what it does: one warning when the
outage starts, saying that it probes once a second, not one per failed probe (which came every
publish timeout, each claiming a retry 30 s away)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats
import pytest

from mongo_outbox import Event, Outbox, PollingRelay, RelaySettings
from mongo_outbox.publishers import NatsPublisher
from tests.support.brokers import Broker
from tests.support.waiting import until


async def test_an_outage_is_told_once_with_what_the_relay_does_meanwhile(
    db: Any, broker: Broker, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await nats.connect(broker.url)
    await nc.jetstream().add_stream(name=unique, subjects=[f"{unique}.>"])
    await nc.close()
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    for order in range(5):
        await outbox.save_with_events(None, db.orders, {"_id": order}, [Event(type="placed")])
    publisher = await NatsPublisher.connect(broker.url, subject=f"{unique}.{{type}}", timeout=1)
    settings = RelaySettings(publish_timeout=1, claim_lease=3)
    relay = PollingRelay(outbox, publisher, settings=settings, interval=0.1)
    await broker.kill()
    caplog.set_level(logging.WARNING, logger="mongo_outbox.relay")
    task = asyncio.ensure_future(relay.run())
    try:
        # The first round fails all five, then a probe a second: four rounds at least.
        await until(lambda: relay.stats.failed >= 8, timeout=30, every=0.1)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
        await publisher.aclose()
    told = [r.getMessage() for r in caplog.records if "broker unavailable" in r.getMessage()]
    assert len(told) == 1, told
    assert "probing it with one event every 1s" in told[0]
    assert (await relay.status()).parked == 0
