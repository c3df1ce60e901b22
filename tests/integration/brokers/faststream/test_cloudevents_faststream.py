"""CloudEvents through FastStream, checked with the official SDK: Kafka's ``ce_`` headers (through
FastStream's in-memory TestKafkaBroker: there is no Kafka server here), and ``inbox_handler`` on
a real NATS JetStream handling the SDK's events once by their ``source`` and ``id``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from cloudevents.core.bindings import http, kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from faststream.kafka import KafkaBroker, KafkaMessage, TestKafkaBroker
from faststream.nats import JStream, NatsBroker

from mongo_outbox import Event, Inbox, inbox_guard
from mongo_outbox.cloudevents import CloudEvents, read_message
from mongo_outbox.faststream import inbox_handler
from mongo_outbox.publishers import FastStreamPublisher
from tests.support.servers import NATS_URL
from tests.support.waiting import until

SOURCE = "urn:example:orders"


def _sdk_events() -> list[CloudEvent]:
    base = {"specversion": "1.0", "type": "invoice.paid", "datacontenttype": "application/json"}
    return [
        CloudEvent(base | {"id": "e-1", "source": "/billing"}, {"n": 1}),
        CloudEvent(base | {"id": "e-1", "source": "urn:other:ledger"}, {"n": 2}),
        CloudEvent(base | {"id": "e-2", "source": "/billing"}, {"n": 3}),
    ]


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_kafka_records_read_as_the_same_cloudevents_in_the_sdk(mode: str) -> None:
    broker = KafkaBroker("127.0.0.1:9092")
    records: list[kafka.KafkaMessage] = []

    @broker.subscriber("orders")
    async def on_order(body: Any, message: KafkaMessage) -> None:
        raw = message.raw_message
        records.append(kafka.KafkaMessage(dict(raw.headers), raw.key, raw.value))

    event = Event(
        type="order.placed",
        aggregate_type="orders",
        aggregate_id="o-1",
        sequence=3,
        version=2,
        payload={"total": 12},
    )
    async with TestKafkaBroker(broker) as fake:
        publisher = FastStreamPublisher(fake, "orders", cloudevents=CloudEvents(SOURCE, mode))
        await publisher.publish(event)
    [record] = records
    if mode == "binary":
        assert record.headers["ce_specversion"] == b"1.0" and record.value == b'{"total":12}'
    read = kafka.from_kafka(record, JSONFormat())
    assert (read.get_id(), read.get_source(), read.get_type()) == (event.id, SOURCE, event.type)
    assert read.get_time() == event.occurred_at and read.get_subject() == "o-1"
    assert read.get_data() == {"total": 12}
    assert str(read.get_extension("eventversion")) == "2"
    assert str(read.get_extension("sequence")) == "3"
    assert record.key == b"o-1"  # still keyed by the aggregate: its partition keeps its order


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_sdk_events_on_kafka_are_handled_once_by_source_and_id(db: Any, mode: str) -> None:
    broker = KafkaBroker("127.0.0.1:9092")
    seen: list[tuple[str, int]] = []

    @inbox_guard(Inbox(db, consumer="kafka-billing"))
    async def bill(event: Event, session: Any) -> None:
        await db.effects.insert_one({"event": event.id}, session=session)
        seen.append((event.id, int(str(event.payload["n"]))))

    @broker.subscriber("invoices")
    async def on_invoice(body: Any, message: KafkaMessage) -> None:
        # What the application does on Kafka (no consumer helper there): read, then guard.
        headers = dict(message.raw_message.headers)
        content_type = headers.get("content-type")
        received = read_message(
            headers,
            message.raw_message.value,
            content_type=content_type.decode() if content_type else None,
        )
        await bill(received.event, message_id=received.id, source=received.source)

    async with TestKafkaBroker(broker) as fake:
        for ce in _sdk_events():
            encode = kafka.to_binary if mode == "binary" else kafka.to_structured
            record = encode(ce, JSONFormat())
            # FastStream takes str headers and sends them as UTF-8, as the SDK's bytes are.
            headers = {name: value.decode() for name, value in record.headers.items()}
            for _ in range(2):
                await fake.publish(record.value, "invoices", key=record.key, headers=headers)
    assert sorted(seen) == [("e-1", 1), ("e-1", 2), ("e-2", 3)]
    assert await db.effects.count_documents({}) == 3


async def test_inbox_handler_handles_sdk_events_on_nats_once_by_source_and_id(
    db: Any, nats_client: Any, nats_stream: str
) -> None:
    js = nats_client.jetstream()
    seen: list[int] = []

    @inbox_handler(Inbox(db, consumer="faststream-billing"))
    async def bill(event: Event, session: Any) -> None:
        await db.effects.insert_one({"event": event.id}, session=session)
        seen.append(int(str(event.payload["n"])))

    for ce in _sdk_events():
        for encode in (http.to_binary, http.to_structured):  # the same event, in both modes
            message = encode(ce, JSONFormat())
            await js.publish(f"{nats_stream}.in", message.body, headers=message.headers)
    broker = NatsBroker(NATS_URL)
    broker.subscriber(
        f"{nats_stream}.in", stream=JStream(nats_stream, declare=False), queue="billing"
    )(bill)
    async with broker:
        await broker.start()
        await until(lambda: len(seen) >= 3)

        async def drained() -> bool:
            info = await js.consumer_info(nats_stream, "billing")
            return info.num_pending == 0 and info.num_ack_pending == 0

        await until(drained, 10)
        await asyncio.sleep(0.3)  # a duplicate, handled twice, would show by now
    assert sorted(seen) == [1, 2, 3]
    assert await db.inbox.count_documents({"status": "done"}) == 3
