"""``OutboxAdmin``, the one public way to operate an outbox, against the emulator in both
modes: typed records of parked entries (an unreadable one marked, not raised on), pages of them
read through a projection, requeues, leases, members and inbox failures; and the console's
view of the same, which reads only what it shows, a page at a time."""

from __future__ import annotations

from typing import Any

import pytest
from bson import ObjectId
from pymongo import AsyncMongoClient

from mongo_outbox import Event, Outbox, PollingRelay
from mongo_outbox.admin import OutboxAdmin, ParkedEntry
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher
from tests.integration.relay.test_requeue_batches import Commands, park_many
from tests.support.console import dead_letter, in_process, leases, park
from tests.support.outboxes import MODES, make_outbox
from tests.support.servers import MongoServer


async def park_unreadable(db: Any, mode: str) -> None:
    """Event ``odd`` of aggregate ``z``, stored by another producer with ``sequence: "x"``,
    parked by the relay that cannot read it."""
    entry = {"type": "odd", "aggregate_type": "orders", "aggregate_id": "z", "sequence": "x"}
    if mode == "collection":
        await db.outbox.insert_one(
            entry
            | {"_id": "odd", "status": "pending", "available_at": utc_now(), "attempts": 0}
            | {"occurred_at": utc_now(), "payload": {}}
        )
    else:
        await db.orders.insert_one(
            {
                "_id": "z",
                "_sequence": 1,
                "_outbox": [entry | {"id": "odd", "occurred_at": utc_now()}],
                "_outbox_due": utc_now(),
            }
        )
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 0


@pytest.mark.parametrize("mode", MODES)
async def test_parked_entries_are_typed_records_filtered_and_requeued(db: Any, mode: str) -> None:
    saved = await park(db, mode)  # a: poison (a placed one went out), b: bad, c: two poison
    admin = OutboxAdmin(Outbox(db, mode=mode, collections=["orders"]))  # type: ignore[arg-type]
    page = await admin.parked()
    assert page.total == page.matching == 4 and page.next_after is None
    assert page.types == ("bad", "poison")
    assert all(isinstance(e, ParkedEntry) and e.unreadable is None for e in page.entries)
    by_id = {e.event_id: e for e in page.entries}
    c_first, c_second = saved["c"]
    assert (by_id[c_second.id].aggregate_id, by_id[c_second.id].sequence) == ("c", 2)
    assert by_id[c_second.id].last_error == "ValueError: cannot encode"
    assert by_id[c_second.id].attempts == 1 and by_id[c_second.id].version == 1
    # A listing reads no payload; asked for whole, the entries hold it.
    assert all("payload" not in e.document for e in page.entries)
    assert all("payload" in e.document for e in (await admin.parked(whole=True)).entries)

    of_c = await admin.parked(aggregates=["c"])
    assert [e.event_id for e in of_c.entries] == sorted([c_first.id, c_second.id])
    assert (of_c.total, of_c.matching) == (4, 2)
    assert await admin.matching(types=["bad"]) == [saved["b"][0].id]
    assert (await admin.backlog()).parked == 4

    # The later of c's two brings the earlier back; a's and b's stay parked.
    assert await admin.requeue([c_second.id]) == 2
    backlog = await admin.backlog()
    assert (backlog.pending, backlog.parked) == (2, 2)
    left = {e.event_id for e in (await admin.parked()).entries}
    assert left == {saved["a"][0].id, saved["b"][0].id}


@pytest.mark.parametrize("mode", MODES)
async def test_an_unreadable_parked_entry_is_a_record_that_says_so(db: Any, mode: str) -> None:
    saved = await park(db, mode)
    await park_unreadable(db, mode)
    admin = OutboxAdmin(Outbox(db, mode=mode, collections=["orders"]))  # type: ignore[arg-type]
    for page in (await admin.parked(), await admin.parked(types=["odd"], limit=10)):
        [odd] = [e for e in page.entries if e.event_id == "odd"]
        assert odd.sequence is None and odd.document["sequence"] == "x"
        assert odd.unreadable is not None and "sequence 'x'" in odd.unreadable
        assert odd.aggregate_id == "z" and odd.type == "odd"
    readable = [e for e in (await admin.parked()).entries if e.event_id != "odd"]
    assert len(readable) == 4 and not any(e.unreadable for e in readable)
    [whole] = await admin.parked_entries(["odd"])
    assert whole.unreadable and "no sequence" in (whole.last_error or "")
    assert saved  # the two aggregates' parked entries beside it are listed as ever


@pytest.mark.parametrize("mode", MODES)
async def test_pages_of_parked_entries_follow_one_another_in_id_order(db: Any, mode: str) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    saved = await park_many(outbox, db, saves=1, events=9)  # 216 of 24 aggregates
    admin = OutboxAdmin(outbox)
    first = await admin.parked(limit=200)
    assert len(first.entries) == 200 and first.next_after == str(first.entries[-1].event_id)
    second = await admin.parked(limit=200, after=first.next_after)
    assert len(second.entries) == 16 and second.next_after is None
    listed = [e.event_id for e in (*first.entries, *second.entries)]
    assert listed == sorted(e.id for e in saved)
    # Filtered, the pages are of the matching ones: 4 of each aggregate's 9 are "noted1".
    noted1 = await admin.parked(types=["noted1"], limit=50)
    rest = await admin.parked(types=["noted1"], limit=50, after=noted1.next_after)
    assert noted1.matching == 96 and (len(noted1.entries), len(rest.entries)) == (50, 46)
    assert {e.type for e in (*noted1.entries, *rest.entries)} == {"noted1"}


async def test_a_page_never_ends_between_two_ids_of_one_text(db: Any) -> None:
    # Two producers: one gave its event an ObjectId, the other that ObjectId's hex as a string.
    # Pages follow one another by the text of the last id, so a page that ended between the two
    # made the next one skip the second.
    oid = ObjectId()
    now = utc_now()
    parked = {"type": "t", "aggregate_type": "orders", "status": "parked", "attempts": 1}
    parked |= {"available_at": now, "occurred_at": now, "payload": {}, "last_error": "E"}
    ids: list[Any] = ["0", oid, str(oid), "z"]
    await db.outbox.insert_many(
        [parked | {"_id": i, "aggregate_id": f"a{n}", "sequence": 1} for n, i in enumerate(ids)]
    )
    admin = OutboxAdmin(Outbox(db))
    for limit in (1, 2, 3):
        listed: list[Any] = []
        after = None
        while True:
            page = await admin.parked(limit=limit, after=after)
            listed += [e.event_id for e in page.entries]
            if page.next_after is None:
                break
            after = page.next_after
        assert sorted(map(repr, listed)) == sorted(map(repr, ids)), limit


async def test_leases_members_partitions_and_inbox_failures_are_typed(db: Any) -> None:
    await leases(db)  # relay "orders" held by host-a:1; group "shop": partition 0 held by m1
    await dead_letter(db, "billing", Event(type="order.paid"), Event(type="order.paid"))
    await dead_letter(db, "shipping", Event(type="order.paid"))
    admin = OutboxAdmin(Outbox(db))
    found = {lease.name: lease for lease in await admin.leases()}
    assert found["orders"].held and found["orders"].holder == "host-a:1"
    assert found["orders"].checkpoint_at is not None and found["orders"].group is None
    assert (found["shop/0"].group, found["shop/0"].partition) == ("shop", 0)
    assert await admin.partitions() == 2
    [member] = await admin.members("shop")  # m0's heartbeat ran out
    assert (member.name, member.partitions) == ("m1", (0,))
    assert await admin.inbox_failures() == {"billing": 2, "shipping": 1}


@pytest.mark.parametrize("mode", MODES)
async def test_a_console_view_reads_only_the_shown_fields_of_large_parked_events(
    mongo: MongoServer, db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    padding = 20_000
    saved = await park_many(outbox, db, saves=1, events=2, padding=padding)  # 48, ~1 MB
    listener = Commands()
    watched: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, tz_aware=True, event_listeners=[listener]
    )
    try:
        async with in_process(watched, watched[db.name], mongo, mode=mode) as http:
            before = listener.read
            page = await http.get("/")
            read = listener.read - before
    finally:
        await watched.close()
    assert page.status_code == 200
    assert all(e.id in page.text for e in saved)
    assert read < len(saved) * padding / 10, f"{read:,} bytes read for one view"


@pytest.mark.parametrize("mode", MODES)
async def test_the_console_pages_parked_events_past_200_and_marks_an_unreadable_one(
    client: Any, mongo: MongoServer, db: Any, mode: str
) -> None:
    outbox = make_outbox(db, mode)
    await outbox.ensure_indexes()
    saved = sorted(e.id for e in await park_many(outbox, db, saves=1, events=9))  # 216
    await park_unreadable(db, mode)  # "odd" comes after every uuid7 id: on the second page
    async with in_process(client, db, mongo, mode=mode) as http:
        first = (await http.get("/")).text
        assert "217 of 217 parked events, the first 200 shown" in first
        assert f'data-event-id="{saved[199]}"' in first and saved[200] not in first
        [link] = [p.split('"')[0] for p in first.split('id="parked-next" href="')[1:]]
        second = await http.get(link.replace("&amp;", "&"))
    assert second.status_code == 200
    text = second.text
    shown = {p.split('"')[0] for p in text.split('data-event-id="')[1:]}
    assert shown == {*saved[200:], "odd"}
    assert "217 of 217 parked events, 17 shown after" in text
    assert 'class="parked unreadable" data-event-id="odd"' in text
    assert "unreadable: sequence &#39;x&#39; is not a whole number from 1" in text
    assert 'id="parked-next"' not in text


def test_a_record_of_odd_fields_says_what_is_wrong_and_never_raises() -> None:
    assert ParkedEntry.of({"_id": "e", "type": "t", "sequence": 3}).unreadable is None
    odd = {
        "_id": {"a": 1},
        "type": 5,
        "sequence": None,
        "version": True,
        "attempts": "2",
        "last_error": ValueError("boom"),
    }
    entry = ParkedEntry.of(odd)
    assert (entry.type, entry.sequence, entry.version, entry.attempts) == (None, None, None, None)
    assert entry.last_error == "boom" and entry.unreadable is not None
    for said in ("type 5 is not text", "version True", "attempts '2'", "no sequence"):
        assert said in entry.unreadable
    wrapped = ParkedEntry.of({"_id": None, "entry": 7, "last_error": "not a document"})
    assert wrapped.unreadable and wrapped.unreadable.startswith("its stored entry is not")


@pytest.mark.parametrize("mode", MODES)
async def test_publications_are_counted_after_a_mark_two_rounds_apart(db: Any, mode: str) -> None:
    outbox = make_outbox(db, mode)
    admin = OutboxAdmin(outbox)
    assert await admin.latest_publication() is None and await admin.published_after(None) == 0
    relay = PollingRelay(outbox, MemoryPublisher())
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="a"), Event(type="b")])
    assert await relay.drain() == 2
    mark = await admin.latest_publication()
    assert mark is not None and await admin.published_after(None) == 2
    assert await admin.published_after(mark) == 0
    await outbox.save_with_events(None, db.orders, {"_id": 2}, [Event(type="c")])
    assert await relay.drain() == 1
    assert await admin.published_after(mark) == 1 and await admin.published_after(None) == 3
