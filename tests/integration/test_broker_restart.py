"""The broker dies mid-run and comes back: both relays deliver every event, once on the stream
(JetStream dedups republished ids), in order per aggregate. The broker is a nats-server of this
test's own (its own port and store), SIGKILLed after ten confirms and restarted a second later."""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mongo_outbox import Backoff, ChangeStreamRelay, Event, Outbox, PollingRelay
from mongo_outbox.publishers import NatsPublisher
from tests.changestream_sources import ScriptedSource, inserts

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"
HAVE_NATS_SERVER = Path(NATS_SERVER).exists()
FAST = Backoff(initial=0.05, maximum=0.3)


class Broker:
    """A nats-server with JetStream that can be killed and started again on the same store."""

    def __init__(self, store: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.store = store
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *[NATS_SERVER, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)],
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for _ in range(100):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            return
        raise RuntimeError("nats-server did not start")

    async def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        await self.process.wait()


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    if not HAVE_NATS_SERVER:
        pytest.skip("needs the nats-server binary to run a broker of the test's own")
    broker = Broker(tmp_path)
    await broker.start()
    yield broker
    if broker.process and broker.process.returncode is None:
        await broker.kill()


class KillsTheBroker:
    """Publishes through ``inner``; after ``after`` confirms it kills the broker and starts it
    again a second later, while publishing goes on failing and backing off."""

    def __init__(self, inner: NatsPublisher, broker: Broker, after: int) -> None:
        self.inner = inner
        self.broker = broker
        self.after = after
        self.confirmed = 0
        self.restarted: asyncio.Task[None] | None = None

    async def publish(self, event: Event) -> None:
        await self.inner.publish(event)
        self.confirmed += 1
        if self.confirmed == self.after:
            await self.broker.kill()
            self.restarted = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        await asyncio.sleep(1.0)
        await self.broker.start()

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("relay_kind", ["polling", "change stream"])
async def test_broker_killed_and_restarted_mid_run(
    db: Any, broker: Broker, unique: str, relay_kind: str
) -> None:
    import nats

    nc = await nats.connect(broker.url)
    await nc.jetstream().add_stream(name=unique, subjects=[f"{unique}.>"])
    await nc.close()
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    saved: list[Event] = []
    for step in range(4):
        for order in range(10):
            result = await outbox.save_with_events(
                None, db.orders, {"_id": order, "step": step}, [Event(type="step")]
            )
            saved += result.events
    inner = await NatsPublisher.connect(broker.url, subject=f"{unique}.{{type}}", timeout=0.5)
    publisher = KillsTheBroker(inner, broker, after=10)
    relay: Any
    if relay_kind == "polling":
        relay = PollingRelay(
            outbox,
            publisher,
            batch_size=10,
            interval=0.05,
            lease=2.0,
            publish_timeout=1.0,
            backoff=FAST,
        )
    else:
        source = ScriptedSource()
        await db.outbox_relays.insert_one({"_id": "orders-relay", "token": {"_data": "t0"}})
        relay = ChangeStreamRelay(
            outbox,
            publisher,
            name="orders-relay",
            source=source,
            batch_size=10,
            claim_lease=2.0,
            publish_timeout=1.0,
            sweep_interval=0.2,
            backoff=FAST,
        )
        entries = await db.outbox.find().sort("_id", 1).to_list(None)
        source.play(inserts(entries, "t1"))
    task = asyncio.create_task(relay.run())

    async def everything_published() -> None:
        while await db.outbox.count_documents({"status": "published"}) < len(saved):  # noqa: ASYNC110
            await asyncio.sleep(0.1)

    await asyncio.wait_for(everything_published(), 60)
    relay.stop()
    await asyncio.wait_for(task, 10)
    assert publisher.restarted is not None  # the broker really went away mid-run
    await publisher.restarted
    await publisher.aclose()

    nc = await nats.connect(broker.url)
    js = nc.jetstream()
    assert (await js.stream_info(unique)).state.messages == len(saved)  # once each
    subscription = await js.subscribe(f"{unique}.>", ordered_consumer=True)
    received = [Event.from_json((await subscription.next_msg(timeout=5)).data) for _ in saved]
    await nc.close()
    assert sorted(e.id for e in received) == sorted(e.id for e in saved)
    for order in range(10):
        assert [e.sequence for e in received if e.aggregate_id == order] == [1, 2, 3, 4]
