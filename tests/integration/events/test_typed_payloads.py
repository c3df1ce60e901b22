"""A pydantic model as payload: stored as JSON (no BSON dates or decimals), published as JSON,
validated back by the consumer with ``payload_as``."""

from __future__ import annotations

import enum
import os
import uuid
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from ipaddress import IPv4Address, IPv6Network
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field, create_model

from mongo_outbox import Event, Outbox, PollingRelay
from mongo_outbox.publishers import MemoryPublisher, RabbitMQPublisher
from tests.support.messages import bind_queue, drain_queue
from tests.support.servers import RABBITMQ_URL

MODES = ["collection", "embedded"]


class ItemAdded(BaseModel):
    cart: uuid.UUID
    sku: str
    price: Decimal
    at: datetime


@pytest.mark.parametrize("mode", MODES)
async def test_a_model_payload_travels_as_json_and_validates_back(db: Any, mode: str) -> None:
    outbox = Outbox(db, mode=mode, collections=["carts"])  # type: ignore[arg-type]
    added = ItemAdded(
        cart=uuid.uuid4(), sku="book", price=Decimal("12.50"), at=datetime.now(timezone.utc)
    )
    await outbox.update_with_events(
        None,
        db.carts,
        {"_id": 1},
        {"$push": {"items": "book"}},
        [Event.of(added, type="cart.item_added")],
        upsert=True,
    )
    if mode == "collection":
        stored = (await db.outbox.find_one())["payload"]
    else:
        stored = (await db.carts.find_one())["_outbox"][0]["payload"]
    assert stored == {"cart": str(added.cart), "sku": "book", "price": "12.50", "at": stored["at"]}
    assert isinstance(stored["at"], str)
    publisher = MemoryPublisher()
    assert await PollingRelay(outbox, publisher).drain() == 1
    received = Event.from_json(publisher.events[0].model_dump_json())
    assert received.payload_as(ItemAdded) == added


# Every pydantic field type whose JSON form differs from its Python form, in a strict model, in a
# model whose fields are strict, and in a lax one. The stored payload is the JSON-mode dump, so
# ``payload_as`` must read it as JSON: in Python mode the strict models refused the UUID,
# Decimal, datetime, enum and tuple they had dumped themselves.


class Colour(str, enum.Enum):
    RED = "red"
    GREEN = "green"


class Size(enum.IntEnum):
    S = 1
    L = 3


class Line(BaseModel):
    model_config = ConfigDict(strict=True)
    sku: str
    quantity: int


def _utf8(data: bytes) -> bool:
    # pydantic dumps bytes as UTF-8 text in JSON mode; other bytes cannot be dumped at all.
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


_INT64 = st.integers(-(2**63), 2**63 - 1)
_KEY = st.text(max_size=5).filter(lambda key: not key.startswith("$") and "\x00" not in key)
_ZONES = [timezone.utc, timezone(timedelta(hours=5, minutes=30)), timezone(-timedelta(hours=8))]
FIELDS: dict[str, tuple[Any, st.SearchStrategy[Any]]] = {
    "id": (uuid.UUID, st.uuids()),
    "price": (Decimal, st.decimals(allow_nan=False, allow_infinity=False, places=4)),
    "at": (
        datetime,
        st.datetimes(
            min_value=datetime(1900, 1, 2),
            max_value=datetime(9999, 12, 30),
            timezones=st.sampled_from(_ZONES),
        ),
    ),
    "day": (date, st.dates()),
    "clock": (time, st.times()),
    "wait": (timedelta, st.timedeltas(min_value=timedelta(0))),
    "colour": (Colour, st.sampled_from(Colour)),
    "size": (Size, st.sampled_from(Size)),
    "pair": (tuple[int, str], st.tuples(_INT64, st.text())),
    "tags": (frozenset[str], st.frozensets(st.text(max_size=5), max_size=3)),
    "raw": (bytes, st.binary(max_size=20).filter(_utf8)),
    "address": (IPv4Address, st.ip_addresses(v=4)),
    "network": (IPv6Network, st.ip_addresses(v=6).map(IPv6Network)),
    "kind": (Literal["a", "b"], st.sampled_from(["a", "b"])),
    "ratio": (float, st.floats(allow_nan=False, allow_infinity=False)),
    "count": (int, _INT64),
    "flag": (bool, st.booleans()),
    "note": (str | None, st.none() | st.text()),
    "lines": (list[Line], st.lists(st.builds(Line, sku=st.text(), quantity=_INT64), max_size=3)),
    "counts": (dict[str, int], st.dictionaries(_KEY, _INT64, max_size=3)),
}
MODELS: list[type[BaseModel]] = [
    create_model(  # type: ignore[call-overload]
        "StrictModel",
        __config__=ConfigDict(strict=True),
        **{name: (kind, ...) for name, (kind, _) in FIELDS.items()},
    ),
    create_model(  # type: ignore[call-overload]
        "StrictFields",
        **{
            name: (kind, Field(strict=True) if name != "kind" else ...)
            for name, (kind, _) in FIELDS.items()
        },
    ),  # pydantic has no strict Literal
    create_model(  # type: ignore[call-overload]
        "LaxModel", **{name: (kind, ...) for name, (kind, _) in FIELDS.items()}
    ),
]
VALUES = st.fixed_dictionaries({name: values for name, (_, values) in FIELDS.items()})


@pytest.fixture
async def rabbitmq(channel: Any, unique: str) -> Any:
    """A queue bound to the exchange ``unique``, and a publisher to that exchange."""
    queue = await bind_queue(channel, unique)
    publisher = await RabbitMQPublisher.connect(RABBITMQ_URL, exchange=unique)
    yield queue, publisher
    await publisher.aclose()


@settings(
    max_examples=int(os.environ.get("TYPED_PAYLOAD_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(values=st.lists(VALUES, min_size=len(MODELS), max_size=len(MODELS)))
async def test_every_field_type_strict_or_lax_round_trips_through_a_real_broker(
    db: Any, rabbitmq: Any, values: list[dict[str, Any]]
) -> None:
    queue, publisher = rabbitmq
    outbox = Outbox(db, collections=["carts"])
    sent = [model(**fields) for model, fields in zip(MODELS, values, strict=True)]
    await outbox.update_with_events(
        None,
        db.carts,
        {"_id": uuid.uuid4().hex},
        {"$set": {"seen": True}},
        [Event.of(payload, type="cart.typed") for payload in sent],
        upsert=True,
    )
    assert await PollingRelay(outbox, publisher).drain() == len(sent)
    received = [Event.from_json(message.body) for message in await drain_queue(queue, len(sent))]
    assert [
        event.payload_as(type(payload)) for event, payload in zip(received, sent, strict=True)
    ] == sent
