"""The console's event pages: one event's detail read whole (payload, the headers a broker gets,
version, times, attempts, last error), and the search box (an exact event id opens its detail,
an aggregate id lists its pending and parked events), in both storage modes; unknown and odd
ids; redaction and the reader's role on the detail page."""

from __future__ import annotations

import html
import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from mongo_outbox import Event, Outbox, PollingRelay, RelaySettings
from mongo_outbox.cli.common import hide
from mongo_outbox.cli.console.auth import Credentials, hash_secret, read_users
from mongo_outbox.publishers import MemoryPublisher
from tests.integration.cli.console.test_console import parked_ids
from tests.integration.cli.console.test_console_operators import ALICE, BOB, sign_in_as
from tests.support.console import TOKEN, console_of, in_process, visitor
from tests.support.servers import MongoServer

ODD = "odd id/?&#=%2F <é> \u202e gnp.exe"
"""An event id with a URL's separators, HTML's specials, a non-ASCII letter and a bidi control."""


async def two_aggregates(db: Any, mode: str) -> dict[str, list[Event]]:
    """Aggregate p: two events parked (the relay cannot encode them); aggregate q: two events
    pending (no relay ran since)."""
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    parked = [
        Event(type="order.placed", payload={"total": 12, "note": "first"}, headers={"x-a": "1"}),
        Event(id=ODD, type="order.paid", version=2, payload={"total": 12}),
    ]
    await outbox.save_with_events(None, db.orders, {"_id": "p"}, parked)
    broken = MemoryPublisher(fail=lambda e: ValueError(f"cannot encode {e.type}"))
    await PollingRelay(outbox, broken, settings=RelaySettings(max_attempts=1)).drain()
    pending = [Event(type="order.placed"), Event(type="order.shipped")]
    await outbox.save_with_events(None, db.orders, {"_id": "q"}, pending)
    return {"p": parked, "q": pending}


def detail_href(page: str, event_id: str) -> str:
    """The link to ``event_id``'s detail page, as the page has it."""
    for href in re.findall(r'href="(/event\?[^"]+)"', page):
        url = html.unescape(href)
        if parse_qs(urlsplit(url).query)["id"] == [event_id]:
            return url
    raise AssertionError(f"no link to {event_id!r}")


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_an_events_detail_shows_it_whole_and_its_headers_as_the_broker_gets_them(
    client: Any, mongo: MongoServer, db: Any, mode: str
) -> None:
    saved = await two_aggregates(db, mode)
    first, pending = saved["p"][0], saved["q"][1]
    async with in_process(client, db, mongo, mode=mode) as http:
        parked_page = await http.get("/event", params={"id": first.id})
        pending_page = await http.get("/event", params={"id": pending.id})
    assert parked_page.status_code == 200 and pending_page.status_code == 200
    text = parked_page.text
    assert 'id="event-status" class="state parked"' in text
    assert 'id="event-type"><bdi>order.placed</bdi>' in text
    assert 'id="event-version">1<' in text and 'id="event-attempts">1<' in text
    assert "cannot encode order.placed" in text
    assert re.search(r'id="event-parked-at">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC<', text)
    assert first.occurred_at.strftime("%Y-%m-%d %H:%M:%S UTC") in text
    assert "&#34;note&#34;: &#34;first&#34;" in text and "&#34;total&#34;: 12" in text
    headers = dict(
        re.findall(r"<tr><td><code><bdi>([^<]+)</bdi></code></td><td><bdi>([^<]*)<", text)
    )
    assert headers == {
        "x-a": "1",
        "event-type": "order.placed",
        "aggregate-type": "orders",
        "aggregate-id": "p",
        "sequence": "1",
    }
    # Read-only console: nobody may requeue, so no button.
    assert 'id="requeue-event"' not in text
    later = pending_page.text
    assert 'class="state pending"' in later and 'id="event-parked-at">-<' in later
    assert 'id="event-attempts">0<' in later and "<bdi>order.shipped</bdi>" in later


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_the_search_opens_an_exact_event_id_and_lists_an_aggregates_events(
    client: Any, mongo: MongoServer, db: Any, mode: str
) -> None:
    saved = await two_aggregates(db, mode)
    async with in_process(client, db, mongo, mode=mode) as http:
        by_id = await http.get("/search", params={"q": saved["q"][0].id})
        of_p = await http.get("/search", params={"q": "p"})
        of_q = await http.get("/search", params={"q": " q "})
    assert by_id.status_code == 303
    assert parse_qs(urlsplit(by_id.headers["location"]).query)["id"] == [saved["q"][0].id]
    assert of_p.status_code == 200 and of_q.status_code == 200
    for listed, mine, other, status in (
        (of_p.text, saved["p"], saved["q"], "parked"),
        (of_q.text, saved["q"], saved["p"], "pending"),
    ):
        assert listed.count(f'class="listed {status}"') == 2
        assert all(detail_href(listed, e.id) for e in mine)
        assert not any(f"id={e.id}" in listed for e in other if e.id != ODD)


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_an_unknown_id_is_a_404_that_says_so(
    client: Any, mongo: MongoServer, db: Any, mode: str
) -> None:
    await two_aggregates(db, mode)
    async with in_process(client, db, mongo, mode=mode) as http:
        unknown = await http.get("/event", params={"id": "no-such-event"})
        searched = await http.get("/search", params={"q": "no-such-thing"})
        empty = await http.get("/event")
    assert unknown.status_code == 404
    assert "this outbox holds no event of id no-such-event" in unknown.text
    assert searched.status_code == 404
    assert "no event of id no-such-thing, and no pending or parked event of aggregate" in (
        searched.text
    )
    assert empty.status_code == 400


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_an_id_of_odd_characters_opens_from_the_list_and_from_the_search(
    client: Any, mongo: MongoServer, db: Any, mode: str
) -> None:
    await two_aggregates(db, mode)
    async with in_process(client, db, mongo, mode=mode) as http:
        listing = (await http.get("/")).text
        href = detail_href(listing, ODD)
        detail = await http.get(href)
        searched = await http.get("/search", params={"q": ODD})
    assert detail.status_code == 200
    assert 'id="event-type"><bdi>order.paid</bdi>' in detail.text
    assert 'id="event-version">2<' in detail.text
    # Shown escaped, its bidi control made visible: never the raw control.
    assert "\u202e" not in detail.text and "&lt;é&gt; \\u202e gnp.exe" in detail.text
    assert searched.status_code == 303
    assert parse_qs(urlsplit(searched.headers["location"]).query)["id"] == [ODD]


async def test_the_detail_redacts_secrets_and_lets_a_reader_look_but_not_requeue(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    saved = await two_aggregates(db, "collection")
    first = saved["p"][0]
    hide("mongodb://u:s3cret-pass@h/x")
    await db.outbox.update_one(
        {"_id": first.id},
        {"$set": {"last_error": f"boom mongodb://u:s3cret-pass@h/x {TOKEN}"}},
    )
    users = read_users([f"alice:operator:{hash_secret(ALICE)}", f"bob:reader:{hash_secret(BOB)}"])
    team = Credentials(token=TOKEN, users=users)
    async with in_process(client, db, mongo, credentials=team, require_sign_in=True) as alice:
        assert (await alice.get("/event", params={"id": first.id})).status_code == 401
        async with visitor(console_of(alice)) as bob:
            await sign_in_as(alice, "alice", ALICE)
            bob_csrf = await sign_in_as(bob, "bob", BOB)
            bobs = (await bob.get("/event", params={"id": first.id})).text
            alices = (await alice.get("/event", params={"id": first.id})).text
            refused = await bob.post(
                "/parked/requeue", data={"csrf": bob_csrf, "event_id": first.id}
            )
    for text in (bobs, alices):
        assert "s3cret-pass" not in text and TOKEN not in text
        assert "boom mongodb://u:***@h/x ***" in text
    assert 'id="requeue-event"' not in bobs and 'id="requeue-event"' in alices
    assert refused.status_code == 403
    assert first.id in await parked_ids(db)


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_each_relays_publish_and_park_rates_come_from_the_entries_it_settled(
    client: Any, mongo: MongoServer, db: Any, mode: str
) -> None:
    from mongo_outbox.cli.common import Connection
    from mongo_outbox.cli.console.data import Sampler, activity_rows

    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    sampler = Sampler(Connection(client, db, outbox), every=60, keep=10)
    for i in range(3):
        await outbox.save_with_events(None, db.orders, {"_id": f"n{i}"}, [Event(type="placed")])
    assert (await sampler.sample()).published_by == {}
    assert await PollingRelay(outbox, MemoryPublisher(), name="north").drain() == 3
    await outbox.save_with_events(None, db.orders, {"_id": "s0"}, [Event(type="placed")])
    await outbox.save_with_events(None, db.orders, {"_id": "s1"}, [Event(type="poison")])
    broken = MemoryPublisher(fail=lambda e: ValueError("no") if e.type == "poison" else None)
    south = PollingRelay(outbox, broken, settings=RelaySettings(max_attempts=1), name="south")
    await south.drain()
    second = await sampler.sample()
    assert second.published == 4 and second.seconds is not None and second.seconds > 0
    assert second.published_by == {"north": 3, "south": 1}
    assert second.parked_by == {"south": 1}
    rates = sampler.rates()
    assert rates["north"] == {"published": 3 / second.seconds, "parked": 0.0}
    assert rates["south"] == {"published": 1 / second.seconds, "parked": 1 / second.seconds}
    # A third sample with nothing done counts nothing, and the window grows.
    third = await sampler.sample()
    assert third.published_by == {} and third.parked_by == {}
    assert sampler.history()["samples"][1]["per_second"] == round(4 / second.seconds, 3)

    # Beside change-stream relays and group members: the group's partitions' rates are its
    # members'.
    report = {
        "relays": [{"name": "orders", "state": "active"}],
        "groups": [
            {
                "name": "shop",
                "partitions": [{"partition": 0}, {"partition": 1}],
                "members": [
                    {"member": "m1", "partitions": [0, 1]},
                    {"member": "m2", "partitions": []},
                ],
            }
        ],
    }
    later = sampler.rates()
    rows = activity_rows(report, {**later, "shop/0": {"published": 2.0, "parked": 0.5}})
    kinds = {row["name"]: (row["kind"], row["state"], row["published_per_second"]) for row in rows}
    assert kinds == {
        "orders": ("change stream", "active", 0.0),
        "m1": ("member of group shop", "active", 2.0),
        "m2": ("member of group shop", "standby", 0.0),
        "north": ("polling", "seen", round(3 / (second.seconds + (third.seconds or 0)), 3)),
        "south": ("polling", "seen", round(1 / (second.seconds + (third.seconds or 0)), 3)),
    }


async def test_the_page_lists_polling_relays_with_their_rates(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    from tests.support.waiting import until

    outbox = Outbox(db)
    await outbox.ensure_indexes()
    async with in_process(client, db, mongo, sample_every=0.05) as http:

        async def sampled() -> bool:
            return len((await http.get("/api/history")).json()["samples"]) >= 1

        await until(sampled)
        await outbox.save_with_events(None, db.orders, {"_id": "a"}, [Event(type="placed")])
        assert await PollingRelay(outbox, MemoryPublisher(), name="west").drain() == 1

        async def seen() -> bool:
            rows = (await http.get("/api/overview")).json()["activity"]
            return any(r["name"] == "west" and r["published_per_second"] > 0 for r in rows)

        await until(seen)
        page = (await http.get("/")).text
    assert 'data-relay="west"' in page and "<bdi>polling</bdi>" in page
