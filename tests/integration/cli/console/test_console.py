"""``mongo-outbox console`` against the test MongoDB, called in process through httpx: what the
page shows, the chart's samples, and the rules of its actions (no credentials, no sign-in, no
CSRF token: refused and nothing changes; signed in: the requeue changes the database). The
real command is started once, to see where it listens and that it says it is read-only."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from mongo_outbox import Event, Inbox, Outbox
from mongo_outbox.admin import OutboxAdmin
from mongo_outbox.cli.console.auth import Credentials, CredentialsError
from tests.support.console import (
    TOKEN,
    confirmed,
    csrf_of,
    dead_letter,
    in_process,
    leases,
    park,
    served,
    session_of,
    sign_in,
)
from tests.support.servers import MongoServer
from tests.support.waiting import until

SIGNED = Credentials(token=TOKEN)


async def parked_ids(db: Any, mode: str = "collection") -> set[str]:
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    return {e.event_id for e in (await OutboxAdmin(outbox).parked()).entries}


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_the_page_shows_backlog_relays_partitions_parked_events_and_inbox_failures(
    client: Any, mongo: MongoServer, db: Any, mode: str
) -> None:
    saved = await park(db, mode)
    await leases(db)
    await dead_letter(db, "billing", Event(type="order.paid"))
    async with in_process(client, db, mongo, mode=mode) as http:
        page = await http.get("/")
    assert page.status_code == 200
    text = page.text
    assert 'id="parked-count">4<' in text and 'id="pending">0<' in text
    for event in (saved["a"][0], saved["b"][0], *saved["c"]):
        assert event.id in text
    assert "cannot encode" in text
    assert ">orders<" in text and "host-a:1" in text  # the change-stream relay
    assert "Group <bdi>shop</bdi>" in text and ">m1<" in text and "no owner" in text  # partition 1
    assert 'live members: <bdi class="member">m1</bdi> (0)</p>' in text  # m0 is dead
    assert ">billing<" in text and "the bug" in text
    assert 'id="read-only"' in text and 'action="/login"' not in text


async def test_the_filters_keep_the_parked_events_of_a_type_or_an_aggregate(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    saved = await park(db)
    async with in_process(client, db, mongo) as http:
        bad = (await http.get("/", params={"type": "bad"})).text
        of_c = (await http.get("/", params={"aggregate": "c"})).text
    assert saved["b"][0].id in bad and saved["a"][0].id not in bad
    assert "1 of 4 parked events" in bad
    assert all(e.id in of_c for e in saved["c"]) and saved["b"][0].id not in of_c
    assert "2 of 4 parked events" in of_c


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_the_chart_counts_what_was_published_between_two_samples(
    client: Any, mongo: MongoServer, db: Any, mode: str
) -> None:
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    from mongo_outbox.cli.common import Connection
    from mongo_outbox.cli.console.data import Sampler
    from mongo_outbox.publishers import MemoryPublisher
    from mongo_outbox.relay import PollingRelay

    sampler = Sampler(Connection(client, db, outbox), every=60, keep=10)
    for i in range(3):
        await outbox.save_with_events(None, db.orders, {"_id": i}, [Event(type="placed")])
    first = await sampler.sample()
    assert (first.pending, first.published) == (3, None)
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 3
    second = await sampler.sample()
    assert (second.pending, second.published) == (0, 3)
    await outbox.save_with_events(None, db.orders, {"_id": 9}, [Event(type="placed")])
    assert await PollingRelay(outbox, MemoryPublisher()).drain() == 1
    third = await sampler.sample()
    assert (third.pending, third.published) == (0, 1)
    assert [s["published"] for s in sampler.history()["samples"]] == [None, 3, 1]


async def test_the_history_endpoint_serves_the_samplers_samples(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    await park(db)
    async with in_process(client, db, mongo, sample_every=0.05) as http:

        async def two_samples() -> bool:
            return len((await http.get("/api/history")).json()["samples"]) >= 2

        await until(two_samples)
        history = (await http.get("/api/history")).json()
        overview = (await http.get("/api/overview")).json()
    assert history["samples"][-1]["parked"] == 4 and history["samples"][-1]["published"] == 0
    assert overview["parked"] == 4 and overview["pending"] == 0


async def test_without_credentials_the_console_is_read_only(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    saved = await park(db)
    async with in_process(client, db, mongo) as http:
        page = (await http.get("/")).text
        assert "Read-only" in page and "Requeue" not in page
        assert 'name="csrf"' not in page  # no form at all
        # A session's own CSRF token does not help: nobody can sign in or act.
        form = {"csrf": session_of(http).csrf}
        login = await http.post("/login", data={**form, "token": ""})
        requeue = await http.post("/parked/requeue", data={**form, "event_id": saved["b"][0].id})
    assert login.status_code == 403 and requeue.status_code == 403
    assert "read-only" in requeue.text
    assert len(await parked_ids(db)) == 4


async def test_a_requeue_needs_a_signed_in_session(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    saved = await park(db)
    bad = saved["b"][0].id
    async with in_process(client, db, mongo, credentials=SIGNED) as http:
        page = (await http.get("/")).text
        assert 'action="/login"' in page and "Requeue chosen" not in page
        csrf = csrf_of(page)
        refused = await http.post("/parked/requeue", data={"csrf": csrf, "event_id": bad})
        wrong = await http.post("/login", data={"csrf": csrf, "token": "not-the-token-at-all"})
        inbox = await http.post(
            "/inbox/requeue", data={"csrf": csrf, "consumer": "billing", "all": "1"}
        )
    assert refused.status_code == 401 and "sign in" in refused.text
    assert wrong.status_code == 401 and inbox.status_code == 401
    assert bad in await parked_ids(db)


async def test_a_requeue_without_the_sessions_csrf_token_is_refused(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    saved = await park(db)
    bad = saved["b"][0].id
    async with in_process(client, db, mongo, credentials=SIGNED) as http:
        csrf = await sign_in(http)
        for form in ({"event_id": bad}, {"csrf": "forged", "event_id": bad}):
            refused = await http.post("/parked/requeue", data=form)
            assert refused.status_code == 403 and "CSRF" in refused.text
        # A token of another session does not do either.
        async with in_process(client, db, mongo, credentials=SIGNED) as other:
            foreign = csrf_of((await other.get("/")).text)
        refused = await http.post("/parked/requeue", data={"csrf": foreign, "event_id": bad})
        assert refused.status_code == 403
        assert bad in await parked_ids(db)
        done = await http.post("/parked/requeue", data={"csrf": csrf, "event_id": bad})
        assert done.status_code == 303
        assert "requeued 1 parked events" in (await http.get("/")).text
    assert bad not in await parked_ids(db)


async def test_signed_in_requeues_change_the_database(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    saved = await park(db)
    paid, placed = Event(type="order.paid"), Event(type="order.placed")
    await dead_letter(db, "billing", paid, placed)
    c_second = saved["c"][1]
    async with in_process(client, db, mongo, credentials=SIGNED) as http:
        csrf = await sign_in(http)
        done = await http.post("/parked/requeue", data={"csrf": csrf, "event_id": c_second.id})
        assert done.status_code == 303
        page = (await http.get("/")).text
        assert "requeued 1 parked events, and 1 earlier parked events of their aggregates" in page
        assert await parked_ids(db) == {saved["a"][0].id, saved["b"][0].id}

        one = {"csrf": csrf, "consumer": "billing", "message_id": paid.id}
        assert (await http.post("/inbox/requeue", data=one)).status_code == 303
        assert [r["message_id"] for r in await Inbox(db, consumer="billing").failed()] == [
            placed.id
        ]
        rest = {"csrf": csrf, "consumer": "billing", "all": "1"}
        assert (await confirmed(http, "/inbox/requeue", rest)).status_code == 303
        assert await Inbox(db, consumer="billing").failed() == []

        # Signing out ends the session: its token acts no more.
        assert (await http.post("/logout", data={"csrf": csrf})).status_code == 303
        again = await http.post(
            "/parked/requeue", data={"csrf": csrf, "event_id": saved["b"][0].id}
        )
        assert again.status_code == 403


async def test_no_credential_is_rendered(client: Any, mongo: MongoServer, db: Any) -> None:
    await park(db)
    await dead_letter(db, "billing", Event(type="order.paid"))
    # A failure whose text holds the console's token and a URI's password (as a driver error
    # might): both are replaced wherever they would show.
    await db.inbox.update_many(
        {}, {"$set": {"last_error": f"boom mongodb://u:s3cret-pass@h/x {TOKEN}"}}
    )
    from mongo_outbox.cli.common import hide

    hide("mongodb://u:s3cret-pass@h/x")
    async with in_process(client, db, mongo, credentials=SIGNED) as http:
        await sign_in(http)
        page = (await http.get("/")).text
    assert (
        TOKEN not in page and "s3cret-pass" not in page and "boom mongodb://u:***@h/x ***" in page
    )


def test_credentials_come_complete_and_long_enough() -> None:
    assert not Credentials.from_env({}).configured
    assert Credentials.from_env({"MONGO_OUTBOX_CONSOLE_TOKEN": TOKEN}).accept(TOKEN, "", "")
    pair = Credentials.from_env(
        {"MONGO_OUTBOX_CONSOLE_USER": "ops", "MONGO_OUTBOX_CONSOLE_PASSWORD": "long-password-1"}
    )
    assert pair.accept("", "ops", "long-password-1") and not pair.accept("", "ops", "wrong")
    assert not pair.accept("", "", "")
    for incomplete in (
        {"MONGO_OUTBOX_CONSOLE_USER": "ops"},
        {"MONGO_OUTBOX_CONSOLE_TOKEN": "short"},
    ):
        with pytest.raises(CredentialsError):
            Credentials.from_env(incomplete)


async def test_the_command_listens_on_localhost_and_says_it_is_read_only(
    mongo: MongoServer, db: Any
) -> None:
    import httpx

    await park(db)
    async with served(mongo, db) as (service, url):
        assert url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient() as http:
            page = await http.get(url)
            assert page.status_code == 200 and "Read-only" in page.text
            # Another name for this address (a rebinding attack's) is refused.
            rebound = await http.get(url, headers={"Host": "evil.example"})
            assert rebound.status_code == 400
        ran = await service.stop(signal.SIGTERM)
    assert ran.code == 0, ran.output


async def test_requeue_all_matching_takes_the_filters_of_the_page(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    saved = await park(db)
    async with in_process(client, db, mongo, credentials=SIGNED) as http:
        csrf = await sign_in(http)
        page = (await http.get("/", params={"type": "poison", "aggregate": "c"})).text
        assert "Requeue all 2 matching" in page
        form = {"csrf": csrf, "matching": "1", "type": "poison", "aggregate": "c"}
        assert (await confirmed(http, "/parked/requeue", form)).status_code == 303
        assert "requeued 2 parked events" in (await http.get("/")).text
    assert await parked_ids(db) == {saved["a"][0].id, saved["b"][0].id}


async def test_the_console_of_several_databases_shows_each_backlog_and_acts_on_the_chosen_one(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    import httpx

    other = client[f"{db.name}_b"]
    try:
        await park(db)
        saved = await park(other)
        await Outbox(other).save_with_events(None, other.orders, {"_id": "p"}, [Event(type="x")])
        env = {"MONGO_OUTBOX_CONSOLE_TOKEN": TOKEN}
        async with served(mongo, db, f"--databases={db.name},{other.name}", env=env) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                first = (await http.get("/")).text
                assert f">{db.name}<" in first and f">{other.name}<" in first
                assert 'id="pending">0<' in first  # the first database's details
                chosen = (await http.get("/", params={"db": other.name})).text
                assert 'id="pending">1<' in chosen and saved["b"][0].id in chosen
                overview = (await http.get("/api/overview", params={"db": other.name})).json()
                assert overview["database"] == other.name and overview["pending"] == 1
                assert (await http.get("/", params={"db": "nope"})).status_code == 404
                csrf = csrf_of(chosen)
                await http.post("/login", data={"csrf": csrf, "token": TOKEN, "db": other.name})
                csrf = csrf_of((await http.get("/", params={"db": other.name})).text)
                form = {"csrf": csrf, "db": other.name, "event_id": saved["b"][0].id}
                done = await http.post("/parked/requeue", data=form)
                assert done.status_code == 303 and done.headers["location"] == f"/?db={other.name}"
        assert saved["b"][0].id not in await parked_ids(other)
        assert len(await parked_ids(db)) == 4
    finally:
        await client.drop_database(other.name)


async def test_weak_or_half_given_credentials_stop_the_command_in_one_line(
    mongo: MongoServer, db: Any
) -> None:
    from tests.support.cli import cli, environment

    where = [f"--uri={mongo.uri}", f"--db={db.name}", "--port=0"]
    weak = await cli("console", *where, env=environment(MONGO_OUTBOX_CONSOLE_TOKEN="short-tkn"))
    assert weak.code == 1 and weak.err.strip() == (
        "mongo-outbox: MONGO_OUTBOX_CONSOLE_TOKEN must be at least 12 characters long, not "
        "counting whitespace"
    )
    half = await cli("console", *where, env=environment(MONGO_OUTBOX_CONSOLE_USER="ops"))
    assert half.code == 1 and "MONGO_OUTBOX_CONSOLE_PASSWORD" in half.err


@pytest.mark.parametrize("history", ["-1", "0", "nan", "inf"])
async def test_a_history_of_no_minutes_stops_the_command_in_one_line(
    mongo: MongoServer, db: Any, history: str
) -> None:
    from tests.support.cli import cli

    where = [f"--uri={mongo.uri}", f"--db={db.name}", "--port=0"]
    ran = await cli("console", *where, f"--history={history}")
    assert ran.code == 1 and ran.err.strip() == (
        f"mongo-outbox: --history must be > 0 minutes, not {float(history)!r}"
    )
