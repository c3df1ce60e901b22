"""What an embedded save remembers on the caller's Event objects (``_write/event_ids.py``): which
ids it must reserve, which document an object went to, and what a refused or doubtful write leaves.
No server: the save's steps are driven by hand, and the answers they would get are made up."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import PrivateAttr
from pymongo import AsyncMongoClient
from pymongo.errors import BulkWriteError, OperationFailure, WriteConcernError

from mongo_outbox import DuplicateEventError, Event, Outbox
from mongo_outbox._relay.store.published_ids import PublishedIds
from mongo_outbox._write.event_ids import forget, remember, to_reserve

HOME = ("shop.orders", 1)


def test_only_ids_that_can_collide_are_reserved() -> None:
    fresh, chosen = Event(type="a"), Event(id="order-1-b", type="b")
    assert to_reserve([fresh, chosen], HOME, in_transaction=False) == ["order-1-b"]
    assert to_reserve([fresh, chosen], HOME, in_transaction=True) == [fresh.id, "order-1-b"]
    remember([fresh], HOME, certain=True)
    assert to_reserve([fresh], HOME, in_transaction=False) == [fresh.id]  # given once: always


def test_an_object_a_save_put_elsewhere_is_refused_and_copies_know_it() -> None:
    event = Event(type="a")
    remember([event], HOME, certain=True)
    for other in (event, event.model_copy(update={"headers": {"k": "v"}})):
        with pytest.raises(DuplicateEventError, match=r"given to a save of shop\.orders 1"):
            to_reserve([other], ("shop.orders", 2), in_transaction=False)
    to_reserve([event], HOME, in_transaction=False)  # its own document: goes on
    # Another database's outbox: its own registry decides (the object is reserved there).
    assert to_reserve([event], ("tenant2.orders", 2), in_transaction=False) == [event.id]


def test_a_transaction_marks_the_object_given_but_pins_no_document() -> None:
    event = Event(type="a")
    before = remember([event], HOME, certain=False)
    assert event._given and event._home is None
    to_reserve([event], ("shop.orders", 2), in_transaction=False)  # the caller may have aborted
    forget(before)
    assert not event._given and event._home is None


def test_marks_are_not_part_of_the_event() -> None:
    event = Event(type="a")
    copy = event.model_copy()
    remember([event], HOME, certain=True)
    assert event == copy and event.model_dump() == copy.model_dump()


def drive(outbox: Outbox, event: Event, failure: BaseException) -> None:
    """Run a save of ``event`` to orders 1 until its document write, and answer that with
    ``failure``; the steps must raise it and ask for nothing more (no reservation released)."""
    plan = outbox._rules.save(None, outbox.db.orders, {"_id": 1}, [event], None)
    steps = outbox._steps(plan, None)
    step = next(steps)
    while step.method != "find_one_and_update":
        answer: Any = [] if step.method == "find" else None
        step = steps.send(answer)
    with pytest.raises(type(failure)):
        steps.throw(failure)


@pytest.fixture
def outbox() -> Any:
    client: Any = AsyncMongoClient("mongodb://127.0.0.1:9", connect=False)
    outbox = Outbox(client.shop, mode="embedded", collections=["orders"])
    outbox._config_checked = True  # no config read: nothing answers here
    return outbox


def test_a_write_whose_durability_is_in_doubt_keeps_the_object_pinned(outbox: Outbox) -> None:
    event = Event(type="a")
    drive(outbox, event, WriteConcernError("waiting for replication timed out", 64))
    # The write happened: the object stays this document's.
    with pytest.raises(DuplicateEventError):
        to_reserve([event], ("shop.orders", 2), in_transaction=False)


def test_a_refused_write_forgets_the_object(outbox: Outbox) -> None:
    event = Event(type="a")
    drive(outbox, event, OperationFailure("not authorized", 13))  # Unauthorized
    assert not event._given and event._home is None


class FakeRegistry:
    """A FAKE registry collection whose insert reports only a write concern error: the write
    happened on the primary, its durability is unknown (no emulator can produce this)."""

    async def insert_many(self, documents: list[Any], ordered: bool) -> None:
        raise BulkWriteError(
            {"writeErrors": [], "writeConcernErrors": [{"code": 64, "errmsg": "waiting"}]}
        )


async def test_a_claim_whose_ids_are_in_doubt_fails_with_the_write_concern_error() -> None:
    ids = PublishedIds(FakeRegistry(), timedelta(days=1))
    with pytest.raises(BulkWriteError) as failure:
        await ids.own({"e-1": (("orders", 1), 1)})
    assert failure.value.details["writeConcernErrors"][0]["code"] == 64


def test_every_way_of_making_an_event_starts_with_pydantic_s_own_private_state() -> None:
    # Event's model_post_init sets its private attributes' defaults itself (faster than
    # pydantic's); what it sets must be what pydantic's own would, for Event and its subclasses.
    defaults = {name: a.default for name, a in Event.__private_attributes__.items()}
    assert set(defaults) == {"_given", "_home", "_validated"}
    built = Event(type="t", payload={})
    assert built.__pydantic_private__ == defaults | {"_validated": id(built)}
    assert built._made_by_validation
    constructed = Event.model_construct(type="t", payload={})
    assert constructed.__pydantic_private__ == defaults
    assert not constructed._made_by_validation
    first, second = Event(type="t", payload={}), Event(type="t", payload={})
    assert first.__pydantic_private__ is not second.__pydantic_private__

    class Marked(Event):
        _note: list[int] = PrivateAttr(default_factory=list)

    marked, other = Marked(type="t", payload={}), Marked(type="t", payload={})
    assert marked.__pydantic_private__ == defaults | {"_validated": id(marked), "_note": []}
    assert marked._note is not other._note
