"""The demo: an order service saving orders with events, and a relay publishing them.

    make demo            # or: python examples/order_service.py [--orders 300] [--mode embedded]

MongoDB: MONGODB_URI, else the mongoeco emulator started here (mongo_outbox.testing, which
needs mongo-outbox[testing] and Python >= 3.13).
Broker: NATS JetStream if it answers at NATS_URL, else RabbitMQ at RABBITMQ_URL, else in memory.
Every tenth order's transaction is aborted on purpose: its events must never be published.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo import AsyncMongoClient

from mongo_outbox import Event, Outbox, PollingRelay
from mongo_outbox.publishers import MemoryPublisher, Publisher
from mongo_outbox.testing import start_emulator

NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")


class Aborted(Exception):
    """Raised inside a transaction on purpose."""


async def place_orders(client: Any, outbox: Outbox, orders: int) -> tuple[list[Event], int]:
    db = outbox.db
    committed: list[Event] = []
    aborted = 0
    for n in range(orders):
        order = {"_id": f"order-{n}", "customer": f"c{n % 17}", "total": 10 + n % 90}
        placed = Event(type="order.placed", payload={"total": order["total"]})
        try:
            async with client.start_session() as session:
                async with await session.start_transaction():
                    saved = await outbox.save_with_events(session, db.orders, order, [placed])
                    await db.customers.update_one(
                        {"_id": order["customer"]},
                        {"$inc": {"orders": 1}},
                        upsert=True,
                        session=session,
                    )
                    if n % 10 == 9:
                        raise Aborted
            committed += saved.events
        except Aborted:
            aborted += 1
            continue
        if n % 3 == 0:  # pay some orders: a second save, guarded by the version just written
            paid = await outbox.save_with_events(
                None,
                db.orders,
                order | {"paid": True},
                [Event(type="order.paid")],
                expected_version=saved.version,
            )
            committed += paid.events
    return committed, aborted


Broker = tuple[str, Publisher, Callable[[], Awaitable[list[Event]]]]
"""The broker's name, a publisher to it, and a function reading back what it received."""


async def nats_broker(run: str) -> Broker | None:
    import nats

    async def quiet(error: Exception) -> None:
        pass  # nats-py would log every refused attempt; absence is an expected answer here

    try:
        # nats-py keeps retrying a refused first connection, so bound the attempt here.
        nc = await asyncio.wait_for(
            nats.connect(NATS_URL, connect_timeout=1, max_reconnect_attempts=1, error_cb=quiet), 3
        )
    except Exception:  # noqa: BLE001 - any failure means "NATS is not there"
        return None
    from mongo_outbox.publishers import NatsPublisher

    js = nc.jetstream()
    await js.add_stream(name=run, subjects=[f"{run}.>"])

    async def received() -> list[Event]:
        sub = await js.subscribe(f"{run}.>", ordered_consumer=True)
        count = (await js.stream_info(run)).state.messages
        events = [Event.from_json((await sub.next_msg(timeout=5)).data) for _ in range(count)]
        await js.delete_stream(run)
        await nc.close()
        return events

    return "NATS JetStream", NatsPublisher(js, subject=f"{run}.{{type}}"), received


async def rabbitmq_broker(run: str) -> Broker | None:
    import aio_pika

    try:
        connection = await aio_pika.connect_robust(RABBITMQ_URL, timeout=2)
    except Exception:  # noqa: BLE001 - any failure means "RabbitMQ is not there"
        return None
    from mongo_outbox.publishers import RabbitMQPublisher

    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    exchange = await channel.declare_exchange(run, aio_pika.ExchangeType.TOPIC)
    queue = await channel.declare_queue(run, auto_delete=False)
    await queue.bind(exchange, "#")

    async def received() -> list[Event]:
        events = []
        while (message := await queue.get(fail=False, timeout=2)) is not None:
            await message.ack()
            events.append(Event.from_json(message.body))
        await queue.delete()
        await exchange.delete()
        await connection.close()
        return events

    return "RabbitMQ", RabbitMQPublisher(exchange), received


async def connect_broker(run: str) -> Broker:
    """NATS if it answers, else RabbitMQ, else an in-memory publisher."""
    for connect in (nats_broker, rabbitmq_broker):
        broker = await connect(run)
        if broker is not None:
            return broker
    memory = MemoryPublisher()

    async def received() -> list[Event]:
        return list(memory.events)

    return "memory (no broker answered)", memory, received


async def main(orders: int, mode: str) -> dict[str, Any]:
    server = None
    uri = os.environ.get("MONGODB_URI")
    if not uri:
        server = start_emulator()
        uri = server.uri
    client: Any = AsyncMongoClient(uri, tz_aware=True)
    run = f"demo{uuid.uuid4().hex[:8]}"
    try:
        outbox = Outbox(client[run], mode=mode, collections=["orders"])  # type: ignore[arg-type]
        await outbox.ensure_indexes()
        broker, publisher, received = await connect_broker(run)
        relay = PollingRelay(outbox, publisher, interval=0.05)
        committed, aborted = await place_orders(client, outbox, orders)
        await relay.drain()
        await publisher.aclose()
        on_broker = await received()
        summary = summarize(broker, orders, committed, aborted, relay, on_broker)
        await client.drop_database(run)
        return summary
    finally:
        await client.close()
        if server:
            server.stop()


def summarize(
    broker: str,
    orders: int,
    committed: list[Event],
    aborted: int,
    relay: PollingRelay,
    on_broker: list[Event],
) -> dict[str, Any]:
    ids = {e.id for e in committed}
    seen = Counter(e.id for e in on_broker)
    in_order = all(
        [e.sequence for e in on_broker if e.aggregate_id == aggregate]
        == sorted(e.sequence or 0 for e in on_broker if e.aggregate_id == aggregate)
        for aggregate in {e.aggregate_id for e in on_broker}
    )
    summary = {
        "broker": broker,
        "orders placed": orders,
        "orders saved": orders - aborted,
        "transactions aborted on purpose": aborted,
        "events committed": len(committed),
        "events published by the relay": relay.stats.published,
        "events read back from the broker": len(on_broker),
        "committed events missing on the broker": len(ids - seen.keys()),
        "events on the broker that were never committed": len(seen.keys() - ids),
        "duplicates (same id twice)": sum(n - 1 for n in seen.values()),
        "per-order sequence order held": in_order,
    }
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=300)
    parser.add_argument("--mode", choices=["collection", "embedded"], default="collection")
    args = parser.parse_args()
    result = asyncio.run(main(args.orders, args.mode))
    sys.exit(0 if result["committed events missing on the broker"] == 0 else 1)
