"""``mongo-outbox relay`` stopping during a MongoDB outage: a standby holds no lease, so it has
nothing to give up and stops at once, with exit status 0, instead of waiting out
``--stop-timeout`` on a release it does not need."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import pytest

from mongo_outbox import Outbox
from mongo_outbox._relay.lease import FencedLease
from tests.support.brokers import free_port
from tests.support.cli import Service
from tests.support.servers import NATS_URL, MongoServer
from tests.support.waiting import until

pytest.importorskip("opentelemetry.exporter.prometheus", reason="needs the prometheus extra")


class MongoGate:
    """A TCP proxy in front of the test MongoDB. ``hang`` makes MongoDB silent for whoever
    connects through it: what is sent is swallowed and nothing comes back, as when its host
    stops answering (no refusal that a client could act on at once)."""

    def __init__(self, uri: str) -> None:
        target = urlsplit(uri)
        self.target = (target.hostname or "127.0.0.1", target.port or 27017)
        self.port = free_port()
        self.url = f"mongodb://127.0.0.1:{self.port}/?directConnection=true"
        self.hung = False
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)

    def hang(self) -> None:
        self.hung = True

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        if self.hung:
            with contextlib.suppress(OSError):
                while await reader.read(65536):
                    pass  # swallowed
            return
        upstream_reader, upstream = await asyncio.open_connection(*self.target)
        self.writers.add(upstream)

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    if not self.hung:
                        sink.write(data)
                        await sink.drain()
            sink.transport.abort()

        await asyncio.gather(copy(reader, upstream), copy(upstream_reader, writer))


async def stop_when_mongodb_hangs(
    relay: Service, gate: MongoGate, ready: Callable[[], Awaitable[bool]]
) -> tuple[Any, float]:
    """Once ``ready()``, make MongoDB silent, SIGTERM the relay: what it ran and the seconds
    its stop took."""
    await until(ready, timeout=30, every=0.1)
    gate.hang()  # MongoDB stops answering the relay
    started = time.monotonic()
    ran = await relay.stop(signal.SIGTERM, timeout=40)
    return ran, time.monotonic() - started


async def test_a_standby_stops_at_once_during_a_mongodb_outage(
    mongo: MongoServer, db: Any, unique: str
) -> None:
    from tests.support.metrics import get

    await Outbox(db).ensure_indexes()
    leader = FencedLease(db.outbox_relays, "orders-relay", timedelta(seconds=120))
    assert await leader.acquire()  # held by another process: the relay stands by
    gate = MongoGate(mongo.uri)
    await gate.start()
    port = free_port()
    relay = await Service(
        "relay",
        f"--uri={gate.url}",
        f"--db={db.name}",
        "--name=orders-relay",
        f"--nats={NATS_URL}",
        f"--subject={unique}.{{type}}",
        f"--metrics-port={port}",
        "--metrics-host=127.0.0.1",
    ).start()
    try:

        async def standing_by() -> bool:
            assert relay.process is not None and relay.process.returncode is None
            try:
                return get(f"http://127.0.0.1:{port}/healthz") == (200, "standby\n")
            except OSError:
                return False

        ran, took = await stop_when_mongodb_hangs(relay, gate, standing_by)
    finally:
        relay.kill()
        await gate.close()
        await leader.release()
    assert ran.code == 0, ran.output
    assert took < 8, f"stopped after {took:.1f}s (--stop-timeout is 10 s): {ran.err}"
    assert "lease runs out" not in ran.err
    assert "relay orders-relay: stopped" in ran.err


async def test_an_active_relay_stops_within_the_stop_timeout_during_a_mongodb_outage(
    mongo: MongoServer, db: Any, unique: str
) -> None:
    # It waited for the change stream's getMore, then for its lease's release, each as long as
    # the driver waits for a server (30 s): past --stop-timeout, so exit status 1.
    await Outbox(db).ensure_indexes()
    gate = MongoGate(mongo.uri)
    await gate.start()
    relay = await Service(
        "relay",
        f"--uri={gate.url}",
        f"--db={db.name}",
        "--name=orders-relay",
        f"--nats={NATS_URL}",
        f"--subject={unique}.{{type}}",
    ).start()
    try:

        async def active() -> bool:
            assert relay.process is not None and relay.process.returncode is None
            found = await db.outbox_relays.find_one({"_id": "orders-relay"})
            return bool(found and found.get("token") is not None)

        ran, took = await stop_when_mongodb_hangs(relay, gate, active)
    finally:
        relay.kill()
        await gate.close()
    assert ran.code == 0, ran.err
    assert took < 8, f"stopped after {took:.1f}s (--stop-timeout is 10 s): {ran.err}"
    assert "relay orders-relay: stopped" in ran.err
