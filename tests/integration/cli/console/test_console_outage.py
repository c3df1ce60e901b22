"""What the console's page and its JSON say when MongoDB does not answer, and what they give the
page's script to tell what is live from what was read once: the outage on top at once, no
number it could not read shown as zero, each part's time of reading, and the table of several
databases served for its refresh. The console reads through a FAKE network path
(``HangingMongo``) that the tests cut, or hang."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from mongo_outbox import Event, Outbox
from tests.support.console import in_process, leases, park, park_one
from tests.support.hanging_mongo import HangingMongo
from tests.support.servers import MongoServer
from tests.support.waiting import until

UNREAD = ("0 of 0 parked events", "No failed messages", 'id="parked-count"', 'id="pending"')


@pytest.fixture
async def path(mongo: MongoServer) -> AsyncIterator[HangingMongo]:
    async with HangingMongo(mongo.uri) as proxy:
        yield proxy


@pytest.fixture
async def through(path: HangingMongo) -> AsyncIterator[AsyncMongoClient[Any]]:
    """A client of the test MongoDB through ``path``, as quick to give up as the command's."""
    reader: AsyncMongoClient[Any] = AsyncMongoClient(
        path.uri, tz_aware=True, serverSelectionTimeoutMS=500
    )
    try:
        yield reader
    finally:
        await reader.close()


async def test_a_fresh_load_while_mongodb_is_down_says_so_on_top_and_shows_no_number(
    through: Any, path: HangingMongo, mongo: MongoServer, db: Any
) -> None:
    await park(db)
    await path.cut()
    async with in_process(through, through[db.name], mongo) as http:
        page = await http.get("/")
        overview = await http.get("/api/overview")
    assert page.status_code == 503
    text = page.text
    outage = text.index('id="outage"')
    assert "MongoDB did not answer" in text and outage < text.index("<main>")
    assert 'id="outage" class="outage" role="alert">' in text  # not hidden
    # ...with its runbook a click away.
    assert '<a class="runbook" href="docs/operating.md#what-a-crash-costs">' in text
    for number in UNREAD:
        assert number not in text
    assert text.count("Not read: MongoDB did not answer.") == 2  # parked events, inbox
    assert 'data-unread="1"' in text
    assert overview.status_code == 503 and overview.json()["error"]


async def test_an_open_page_s_numbers_fail_at_once_when_mongodb_stops_answering(
    through: Any, path: HangingMongo, mongo: MongoServer, db: Any
) -> None:
    await park(db)
    async with in_process(through, through[db.name], mongo) as http:
        page = await http.get("/")
        assert page.status_code == 200 and 'id="outage" class="outage" role="alert" hidden' in (
            page.text
        )
        assert (await http.get("/api/overview")).json()["parked"] == 4
        await path.cut()
        started = time.monotonic()
        down = await http.get("/api/overview")
        assert down.status_code == 503 and "parked" not in down.json()
        assert time.monotonic() - started < 3  # the client's server selection, not more
        await path.mend()

        async def back() -> bool:
            return (await http.get("/api/overview")).status_code == 200

        await until(back)  # once the client found the server again
        assert (await http.get("/api/overview")).json()["parked"] == 4


async def test_a_hung_connection_shows_as_an_outage_within_the_read_timeout(
    through: Any,
    path: HangingMongo,
    mongo: MongoServer,
    db: Any,
) -> None:
    await park(db)
    # One sample, taken before the hang is set: a sampler's aggregate swallowed in place of the
    # page's let the page answer 200 (on a loaded machine its next sample came at that moment).
    async with in_process(
        through, through[db.name], mongo, read_timeout=1.0, sample_every=3600
    ) as http:
        assert (await http.get("/api/overview")).status_code == 200

        async def sampled() -> bool:
            return len((await http.get("/api/history")).json()["samples"]) >= 1

        await until(sampled)
        path.hang_next("aggregate")
        answer = await asyncio.wait_for(http.get("/api/overview"), 10)
        assert path.hung.is_set()
        assert answer.status_code == 503 and answer.json() == {"error": "no answer within 1 s"}


async def test_what_the_page_read_once_carries_its_time_and_what_it_showed(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    await park(db)
    await leases(db)
    async with in_process(client, db, mongo) as http:
        text = (await http.get("/")).text
    assert 'data-read-at="' in text and text.count('class="as-of') == 4
    assert '<section id="parked" class="read-once" data-total="4">' in text
    # No failure yet: its absence is what may go stale.
    assert '<section id="inbox" class="read-once" data-total="0">' in text
    assert 'data-signature="orders|active|host-a:1;shop|0|active|m1;shop|1|inactive|"' in text


async def test_the_table_of_several_databases_is_served_for_its_refresh(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    other = client[f"{db.name}_b"]
    try:
        await park(db)
        async with in_process(client, db, mongo, databases=(other,)) as http:
            first = (await http.get("/api/outboxes")).json()["outboxes"]
            assert [(o["database"], o["pending"], o["parked"]) for o in first] == [
                (db.name, 0, 4),
                (other.name, 0, 0),
            ]
            await Outbox(other).save_with_events(None, other.orders, {"_id": 1}, [Event(type="x")])
            await park_one(db, "d")
            then = (await http.get("/api/outboxes")).json()["outboxes"]
            assert [(o["database"], o["pending"], o["parked"]) for o in then] == [
                (db.name, 0, 5),
                (other.name, 1, 0),
            ]
            page = (await http.get("/")).text
            assert f'data-database="{other.name}"' in page and 'class="pending">1<' in page
    finally:
        await client.drop_database(other.name)
