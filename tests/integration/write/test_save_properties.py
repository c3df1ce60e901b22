"""Property-based: any input to the write path either saves and comes through a relay unchanged,
or raises an ``OutboxError`` and writes nothing.

Each example runs a few saves, built from generated documents, ids, payloads and events (with
edge cases on purpose: ids beyond 64 bits or spelled like ObjectIds, keys with ``$`` or NUL, lone
surrogates, NaN, values BSON cannot encode, event ids reused across and within saves, events of
another aggregate, any ``expected_version``), in a database of its own. After every save the whole
database is read back: a refused save changed nothing, in the aggregate collection, the outbox
collection or the event-id registry; a save stored the document as given. At the end a
``PollingRelay`` drains everything, and the published events must equal ``Saved.events`` field by
field, with sequences per aggregate gap-free from 1.
"""

from __future__ import annotations

import math
import os
import uuid
from collections import defaultdict
from typing import Any

import pytest
from bson import ObjectId
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mongo_outbox import Event, Outbox, OutboxError, PollingRelay, Saved
from mongo_outbox.publishers import MemoryPublisher
from tests.support.contents import contents

MODES = ["collection", "embedded"]
# Examples per mode: few enough for CI on the emulator; raise it for a deeper search.
EXAMPLES = int(os.environ.get("SAVE_PROPERTY_EXAMPLES", "50"))
OWNED = {
    "_version",
    "_sequence",
    "_outbox",
    "_outbox_due",
    "_outbox_claim",
    "_outbox_wait",
    "_outbox_sent",
}

few_ids = st.sampled_from([1, 2, "a", "b"])  # a few, so that saves update each other's documents
EVENT_IDS = ["e-1", "e-2", "e-3", "e-4", "e-5", "e-6"]  # reused within and across saves on purpose
clean_text = st.text(alphabet="abé漢\U0001f600.", max_size=4)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)


def save_of(hostile: bool) -> st.SearchStrategy[dict[str, Any]]:
    """One save's input. An ordinary save draws only what MongoDB and JSON can hold; a hostile one
    draws, at every turn, an edge case as often as not. Half the saves are ordinary: a suite that
    refused nearly every save would prove little about those that go through."""

    def edgy(usual: st.SearchStrategy[Any], edge: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(usual, edge) if hostile else usual

    text = edgy(clean_text, st.text(alphabet=st.sampled_from("a$\x00\ud800"), min_size=1))
    keys = edgy(text, st.sampled_from(["_version", "_outbox", "x.y", "$set"]))
    ints = edgy(int64, st.sampled_from([2**63, -(2**63) - 1, 2**64]))

    def nested(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.recursive(
            leaves,
            lambda inner: st.one_of(
                st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)
            ),
            max_leaves=6,
        )

    floats = edgy(finite, st.sampled_from([math.nan, math.inf, -math.inf]))
    json_values = nested(st.one_of(st.none(), st.booleans(), ints, floats, text))
    values = nested(
        edgy(
            st.one_of(st.none(), st.booleans(), ints, finite, text, st.binary(max_size=4)),
            st.just(set()),  # no BSON type
        )
    )
    doc_ids = edgy(
        st.one_of(few_ids, st.builds(ObjectId)),
        st.one_of(
            st.integers(min_value=-(2**64), max_value=2**64),
            text,
            st.builds(lambda: str(ObjectId())),
            st.builds(lambda: str(uuid.uuid4())),
            st.sampled_from([{"compound": 1}, 1.5, None]),
        ),
    )
    event_fields = st.fixed_dictionaries(
        {
            "type": edgy(clean_text.filter(bool), st.sampled_from(["", "\ud800"])),
            "payload": st.dictionaries(keys, json_values, max_size=3),
        },
        optional={
            "id": st.sampled_from(EVENT_IDS),
            "aggregate_type": edgy(st.just("orders"), st.sampled_from(["customers", "\ud800"])),
            "headers": st.dictionaries(st.sampled_from(["h", "k"]), text, max_size=2),
            "correlation_id": text,
            "version": edgy(st.integers(1, 3), st.sampled_from([0, 2**63])),
            # Ordinary events leave it to the save; a hostile one may name another aggregate.
            **({"aggregate_id": st.one_of(few_ids, st.just(2**63))} if hostile else {}),
        },
    )
    return st.fixed_dictionaries(
        {
            "id": doc_ids,
            "body": st.dictionaries(keys, values, max_size=4),
            "events": st.lists(event_fields, max_size=3),
            "expected_version": st.sampled_from([None, 0, "current", "current", 1, 7]),
        },
        optional={"no_id": st.just(True)},
    )


saves = st.lists(st.one_of(save_of(hostile=False), save_of(hostile=True)), min_size=2, max_size=5)


def build_events(fields: list[dict[str, Any]]) -> list[Event] | None:
    try:
        return [Event(**f) for f in fields]
    except OutboxError:  # refused when built: nothing could have been written
        event("an Event refused when built")
        return None


@pytest.mark.parametrize("mode", MODES)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=saves)
async def test_every_save_either_comes_through_unchanged_or_writes_nothing(
    client: Any, mode: str, plan: list[dict[str, Any]]
) -> None:
    db = client[f"p_{uuid.uuid4().hex[:12]}"]
    try:
        await run_example(db, mode, plan)
    finally:
        await client.drop_database(db.name)


async def run_example(db: Any, mode: str, plan: list[dict[str, Any]]) -> None:
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    versions: dict[Any, int] = defaultdict(int)
    saved: list[Saved] = []
    for step in plan:
        events = build_events(step["events"])
        if events is None:
            continue
        document = {"_id": step["id"], **step["body"]}
        if step.get("no_id"):
            del document["_id"]
        expected = step["expected_version"]
        if expected == "current":
            expected = versions[repr(step["id"])]
        before = await contents(db)
        try:
            result = await outbox.save_with_events(
                None, db.orders, document, events, expected_version=expected
            )
        except OutboxError as error:
            event(f"a save refused: {type(error).__name__}")
            assert await contents(db) == before, "a refused save wrote something"
            continue
        event("a save stored")
        key = repr(result.id)
        assert result.version == versions[key] + 1
        versions[key] = result.version
        stored = await db.orders.find_one({"_id": result.id})
        given_fields = {k: v for k, v in document.items() if k not in OWNED}
        assert {k: v for k, v in stored.items() if k not in OWNED} == given_fields
        saved.append(result)
    await assert_relayed_unchanged(outbox, saved)


async def assert_relayed_unchanged(outbox: Outbox, saved: list[Saved]) -> None:
    publisher = MemoryPublisher()
    await PollingRelay(outbox, publisher).drain()
    expected = {e.id: e for result in saved for e in result.events}
    assert len(publisher.events) == len(expected)
    for published in publisher.events:
        assert published == expected[published.id]
        assert same_payload(published.payload, expected[published.id].payload)
    sequences: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for result in saved:
        for stored in result.events:
            sequences[(stored.aggregate_type, stored.aggregate_id)].append(stored.sequence or 0)
    for numbers in sequences.values():
        assert numbers == list(range(1, len(numbers) + 1))


def same_payload(a: Any, b: Any) -> bool:
    """Equal, and of the same types: ``1 == 1.0 == True`` would hide a changed type."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_payload(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_payload(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)
