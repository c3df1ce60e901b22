"""A billing service on FastStream: the relay publishes the orders' events through the app's own
broker, and a guarded subscriber writes one invoice per order, once, in the inbox's transaction.

    python examples/faststream_service.py [--orders 30] [--broker nats|rabbitmq]

The orders are saved first; then the FastStream app starts. After startup the relay publishes
every event, and then all of them again (as a relay that crashed before marking them would):
the inbox skips the copies. One order in ten has a negative total, which the handler refuses
with ``PoisonMessage``: the inbox records it as failed (the dead letter) and it is acked, not
retried. Once every order is invoiced or dead-lettered the app counts them, exits and prints the
summary.

MongoDB: MONGODB_URI, else the mongoeco emulator started here (mongo_outbox.testing, which needs
mongo-outbox[testing] and Python >= 3.13). Brokers: NATS_URL (a JetStream stream of the run's
own) or RABBITMQ_URL (an exchange and a queue of the run's own), through FastStream
(``pip install 'mongo-outbox[faststream]' 'faststream[nats,rabbit]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Annotated, Any

from faststream import Context, FastStream
from pydantic import BaseModel
from pymongo import AsyncMongoClient

from mongo_outbox import Event, Inbox, Outbox, PoisonMessage, PollingRelay
from mongo_outbox.faststream import inbox_handler
from mongo_outbox.publishers import FastStreamPublisher
from mongo_outbox.testing import start_emulator

NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
QUIET = logging.DEBUG  # FastStream logs each message at this level: out of the summary's way
SETTLE_WITHIN = 90.0  # seconds from startup: every order invoiced or dead-lettered, or it fails
STATUSES = ("processing", "retrying", "done", "failed")


class OrderPlaced(BaseModel):
    order: int
    cents: int


Subscribe = Callable[[Callable[..., Awaitable[None]]], object]


def wire(broker_name: str, name: str) -> tuple[Any, Subscribe, FastStreamPublisher]:
    """The broker, its subscriber decorator and the relay's publisher, all named ``name``."""
    if broker_name == "nats":
        from faststream.nats import JStream, NatsBroker

        nats_broker = NatsBroker(NATS_URL, log_level=QUIET)
        stream = JStream(name, subjects=[f"{name}.>"])
        subscriber = nats_broker.subscriber(f"{name}.>", stream=stream, queue="billing")
        publisher = FastStreamPublisher(nats_broker, f"{name}.{{type}}", stream=name)
        return nats_broker, subscriber, publisher
    from faststream.rabbit import (
        Channel,
        ExchangeType,
        RabbitBroker,
        RabbitExchange,
        RabbitQueue,
    )

    rabbit_broker = RabbitBroker(RABBITMQ_URL, log_level=QUIET)
    exchange = RabbitExchange(name, type=ExchangeType.TOPIC, auto_delete=True)
    queue = RabbitQueue(name, routing_key="#", auto_delete=True)
    # One message at a time: the emulator's transactions do not bear concurrent handlers.
    rabbit_subscriber = rabbit_broker.subscriber(queue, exchange, channel=Channel(prefetch_count=1))
    return (
        rabbit_broker,
        rabbit_subscriber,
        FastStreamPublisher(rabbit_broker, "{type}", exchange=name),
    )


async def run(db: Any, orders: int, broker_name: str) -> dict[str, object]:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    for n in range(orders):
        cents = -1 if n % 10 == 9 else 100 * (n + 1)  # every tenth order is poison
        event = Event.of(OrderPlaced(order=n, cents=cents), type="order.placed")
        await outbox.save_with_events(None, db.orders, {"_id": n, "cents": cents}, [event])

    broker, subscriber, publisher = wire(broker_name, f"billing-{db.name}")
    app = FastStream(broker)
    inbox = Inbox(db, consumer="billing", transactional=True)

    relayed = asyncio.Event()

    @inbox_handler(inbox, payload=OrderPlaced)
    async def bill(order: OrderPlaced, session: Any) -> None:
        if order.cents < 0:
            raise PoisonMessage(f"order {order.order} has a negative total")
        await db.invoices.insert_one({"order": order.order, "cents": order.cents}, session=session)

    @subscriber
    async def bill_after_the_relay(message: Annotated[Any, Context("message")]) -> None:
        # Billing starts once both relay passes are done, so every copy is queued by then. It
        # waits here, before the inbox opens its transaction: on the mongoeco emulator a
        # transaction open across the relay's writes can be undone later, with the writes other
        # sessions made meanwhile (docs/testing.md); a replica set has no such limit.
        await relayed.wait()
        await bill(message)

    published = 0
    deadline = 0.0  # set at startup

    @app.after_startup
    async def relay_twice() -> None:
        nonlocal published, deadline
        deadline = asyncio.get_running_loop().time() + SETTLE_WITHIN
        relay = PollingRelay(outbox, publisher)
        published += await relay.drain()
        print(f"relay pass 1: {published} published", file=sys.stderr)
        # As after a relay crash between the broker's confirm and the outbox's mark.
        due = datetime(2000, 1, 1, tzinfo=timezone.utc)
        await db.outbox.update_many({}, {"$set": {"status": "pending", "available_at": due}})
        published += await PollingRelay(outbox, publisher).drain()
        print(f"relay pass 2: {published} published in all; billing starts", file=sys.stderr)
        relayed.set()
        app_tasks.append(asyncio.create_task(exit_when_settled()))

    summary: dict[str, object] = {}

    async def exit_when_settled() -> None:
        settled = {"status": {"$in": ["done", "failed"]}}
        while (done := await db.inbox.count_documents(settled)) < orders:
            if asyncio.get_running_loop().time() > deadline:
                # Say how far billing got rather than hang: a test shows this line.
                counts = {s: await db.inbox.count_documents({"status": s}) for s in STATUSES}
                summary["error"] = f"{done} of {orders} settled after {SETTLE_WITHIN} s: {counts}"
                app.exit()
                return
            await asyncio.sleep(0.05)
        failed = await inbox.failed()
        invoices = await db.invoices.find().to_list(None)
        summary.update(
            {
                "broker": "NATS JetStream" if broker_name == "nats" else "RabbitMQ",
                "orders saved": orders,
                "events published": published,
                "invoices written": len(invoices),
                "orders invoiced twice": len(invoices) - len({i["order"] for i in invoices}),
                "dead-lettered": len(failed),
            }
        )
        app.exit()

    app_tasks: list[asyncio.Task[None]] = []
    await asyncio.wait_for(app.run(log_level=QUIET), SETTLE_WITHIN + 30)
    if broker_name == "nats":
        await drop_stream(f"billing-{db.name}")
    return summary


async def drop_stream(name: str) -> None:
    import nats

    nc = await nats.connect(NATS_URL)
    try:
        await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", type=int, default=30)
    parser.add_argument("--broker", choices=["nats", "rabbitmq"], default="nats")
    args = parser.parse_args()
    uri = os.environ.get("MONGODB_URI")
    emulator = None
    if not uri:
        emulator = start_emulator()
        uri = emulator.uri
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri, tz_aware=True)
    name = f"faststream_demo_{uuid.uuid4().hex[:8]}"
    try:
        summary = await run(client[name], args.orders, args.broker)
    finally:
        await client.drop_database(name)
        await client.close()
        if emulator is not None:
            emulator.stop()
    if "error" in summary:
        print(f"billing did not finish: {summary['error']}", file=sys.stderr)
        return 1
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key.ljust(width)}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
