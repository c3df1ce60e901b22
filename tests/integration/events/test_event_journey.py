"""Events at the edges of what they may hold, from the save to the consumer's decode: what is
refused is refused when the Event is built (or saved), and what is stored reaches a broker as
the same event, whatever the event's class or the client's codec options."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

import pytest
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from pydantic import BaseModel
from pymongo import AsyncMongoClient

from mongo_outbox import Event, InvalidEventError, PollingRelay
from mongo_outbox.brokers._consuming import decode
from mongo_outbox.events import MAX_PAYLOAD_DEPTH
from mongo_outbox.publishers import MemoryPublisher
from tests.support.outboxes import MODES, make_outbox

INDIA = timezone(timedelta(hours=5, minutes=30))


class Placed(BaseModel):
    at: datetime
    total: float


class OrderPlaced(Event):
    """A typed event: a subclass that narrows its type and its payload."""

    type: Literal["order.placed"] = "order.placed"
    payload: Placed  # type: ignore[assignment]


async def relayed(outbox: Any, db: Any, event: Event) -> Event:
    """``event`` saved, relayed, and decoded as a consumer would."""
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher)
    await relay.drain()
    assert len(publisher.events) == 1, await relay.parked()
    return Event.from_json(publisher.events[0].model_dump_json())


@pytest.mark.parametrize("mode", MODES)
async def test_a_typed_subclass_s_payload_is_stored_as_an_event_s_and_read_back(
    db: Any, mode: str
) -> None:
    # Its payload was stored as model_dump() made it (a BSON date, its offset and microseconds
    # gone): the relay, which reads entries as Event, parked every such event.
    event = OrderPlaced(payload=Placed(at=datetime(2024, 1, 1, 12, 0, 0, 123456, INDIA), total=2))
    received = await relayed(make_outbox(db, mode), db, event)
    assert received.payload_as(Placed) == event.payload
    assert received.payload == {"at": "2024-01-01T12:00:00.123456+05:30", "total": 2.0}


@pytest.mark.parametrize("mode", MODES)
async def test_a_typed_subclass_s_payload_no_event_takes_is_refused_before_it_is_written(
    db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    event = OrderPlaced(payload=Placed(at=datetime.now(timezone.utc), total=float("nan")))
    with pytest.raises(InvalidEventError, match="is no Event payload") as refused:
        await outbox.save_with_events(None, db.orders, {"_id": 1}, [event])
    assert refused.value.event_id == event.id
    assert await db.orders.count_documents({}) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("document_class", [SON, RawBSONDocument], ids=["son", "raw"])
async def test_a_client_of_another_document_class_relays_the_same_event(
    mongo: Any, mode: str, document_class: Any
) -> None:
    # With RawBSONDocument the relay read every payload raw: each failed the JSON check, and
    # every event was parked.
    client: Any = AsyncMongoClient(mongo.uri, document_class=document_class)
    db = client[f"t_{uuid.uuid4().hex[:12]}"]
    try:
        event = Event(
            type="t", payload={"a": {"b": [1, 2.5, "x", {"c": None}]}}, headers={"h": "v"}
        )
        received = await relayed(make_outbox(db, mode), db, event)
        assert (received.payload, received.headers) == (event.payload, event.headers)
    finally:
        await client.drop_database(db.name)
        await client.close()


def nested(depth: int) -> dict[str, Any]:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def test_a_payload_nested_beyond_what_mongodb_stores_is_refused_when_built() -> None:
    # 200 deep was stored (by the emulator; MongoDB refuses past 100) and published, and no
    # consumer could decode it (pydantic's JSON parser stops at 200).
    Event(type="t", payload=nested(MAX_PAYLOAD_DEPTH))
    with pytest.raises(InvalidEventError, match=f"nested deeper than {MAX_PAYLOAD_DEPTH}"):
        Event(type="t", payload=nested(MAX_PAYLOAD_DEPTH + 1))


@pytest.mark.parametrize("at", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"])
def test_a_time_beyond_utc_s_range_is_no_event_and_a_consumer_refuses_it_once(at: str) -> None:
    # OverflowError escaped Event: the consumers gave the message back, at once, for ever
    # (8,666 RabbitMQ redeliveries in 5 s).
    body = f'{{"type": "t", "occurred_at": "{at}"}}'.encode()
    with pytest.raises(InvalidEventError, match="out of range in UTC"):
        Event.from_json(body)
    reason = decode("m-1", body)
    assert isinstance(reason, str) and "m-1 is not an Event" in reason
