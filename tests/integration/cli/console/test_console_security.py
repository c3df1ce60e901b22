"""``mongo-outbox console`` against a hostile visitor, through HTTP (the console's application in
process through httpx, from client addresses of the test's choosing, or the real command): sign-in
guesses limited before they are checked, the Host checked wherever it listens, no credential
shown from any text and the page whole whatever the secrets are, reading behind a sign-in,
cookies' Secure and the proxies believed, sessions that anonymous requests cannot push out, and
the sign-out cookie."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from mongo_outbox import Event
from mongo_outbox.cli.console.auth import COOKIE, Credentials
from mongo_outbox.cli.console.limits import PER_CLIENT, Rate, SignInLimit
from tests.support.console import (
    TOKEN,
    console_of,
    csrf_of,
    dead_letter,
    in_process,
    leases,
    park,
    served,
    sign_in,
    visitor,
)
from tests.support.servers import MongoServer

SIGNED = Credentials(token=TOKEN)
WRONG = "not-the-token-at-all"


async def guess(http: httpx.AsyncClient, csrf: str, token: str) -> httpx.Response:
    return await http.post("/login", data={"csrf": csrf, "token": token})


def signed_in(page: str) -> bool:
    return 'action="/logout"' in page


async def test_twenty_guesses_at_once_then_the_right_one_are_refused_unchecked(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    async with in_process(client, db, mongo, credentials=SIGNED) as http:
        csrf = csrf_of((await http.get("/")).text)
        answers = await asyncio.gather(*(guess(http, csrf, WRONG) for _ in range(20)))
        codes = sorted(answer.status_code for answer in answers)
        # Five checked (the client's burst), fifteen refused before their answer was checked.
        assert codes == [401] * 5 + [429] * 15
        right = await guess(http, csrf, TOKEN)
        assert right.status_code == 429 and int(right.headers["retry-after"]) >= 1
        assert not signed_in((await http.get("/")).text)
        # An operator at another address is not held up by this one's guesses.
        async with visitor(console_of(http), "10.0.0.7") as operator:
            await sign_in(operator)
            assert signed_in((await operator.get("/")).text)


async def test_guesses_from_many_addresses_are_limited_overall(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    overall = Rate(burst=6, every=0.5)
    async with in_process(client, db, mongo, credentials=SIGNED, guesses_overall=overall) as http:
        console = console_of(http)
        # The limit's own clock, moved by hand: on a loaded machine the six guesses took over
        # the 0.5 s in which a place comes free again, and the operator's was let through.
        now = [0.0]
        console.guesses = SignInLimit(PER_CLIENT, overall, clock=lambda: now[0])
        codes = []
        for n in range(6):
            async with visitor(console, f"10.0.1.{n}") as guesser:
                csrf = csrf_of((await guesser.get("/")).text)
                codes.append((await guess(guesser, csrf, WRONG)).status_code)
        assert codes == [401] * 6
        async with visitor(console, "10.0.2.1") as operator:
            csrf = csrf_of((await operator.get("/")).text)
            assert (await guess(operator, csrf, TOKEN)).status_code == 429
            # Not a lockout: once a place is free again, the right answer signs in.
            now[0] += overall.every
            assert (await guess(operator, csrf, TOKEN)).status_code == 303
            assert signed_in((await operator.get("/")).text)


async def test_the_host_is_checked_wherever_the_console_listens(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    async with in_process(client, db, mongo, host="0.0.0.0") as http:
        assert (await http.get("/")).status_code == 200  # Host: 127.0.0.1
        rebound = await http.get("/", headers={"Host": "evil.example"})
        assert rebound.status_code == 400
        json = await http.get("/api/overview", headers={"Host": "evil.example"})
        assert json.status_code == 400
    proxied = ("console.example.com",)
    async with in_process(client, db, mongo, host="0.0.0.0", allowed_hosts=proxied) as http:
        # A reverse proxy that keeps the original Host (Caddy's and Traefik's default).
        kept = await http.get("/", headers={"Host": "Console.Example.com:443"})
        assert kept.status_code == 200
        assert (await http.get("/", headers={"Host": "evil.example"})).status_code == 400
        # Two Hosts: each reader could take another one.
        twice = [(b"host", b"console.example.com"), (b"host", b"evil.example")]
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=console_of(http).app), base_url="http://x"
        ) as raw:
            request = raw.build_request("GET", "/")
            request.headers = httpx.Headers(twice)
            assert (await raw.send(request)).status_code == 400


async def test_the_command_on_another_loopback_address_checks_the_host_against_its_list(
    mongo: MongoServer, db: Any
) -> None:
    listening = ("--host=127.0.0.2", "--allowed-host=console.example", "--no-require-sign-in")
    async with served(mongo, db, *listening) as (_, url):
        assert url.startswith("http://127.0.0.2:")
        async with httpx.AsyncClient() as http:
            assert (await http.get(url)).status_code == 200
            assert (await http.get(url, headers={"Host": "evil.example"})).status_code == 400
            allowed = await http.get(url, headers={"Host": "console.example"})
            assert allowed.status_code == 200 and "Read-only" in allowed.text


async def test_credentials_in_any_text_are_redacted_before_rendering(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    saved = await park(db)
    await leases(db)
    await dead_letter(db, "billing", Event(type="order.paid"))
    await db.outbox.update_many(
        {"status": "parked"},
        {"$set": {"last_error": "connect failed: mongodb://u:pass-in-error@db:27017/x"}},
    )
    await db.outbox_relays.insert_one(
        {"_id": "amqp://guest:relay-pass@rabbit/", "owner": "nats://tok-en-secret@nats:4222"}
    )
    await db.inbox.update_many({}, {"$set": {"last_error": "redis://:redis-pass@r:6379/0 down"}})
    async with in_process(client, db, mongo, credentials=SIGNED) as http:
        await sign_in(http)
        page = (await http.get("/")).text
        overview = (await http.get("/api/overview")).text
    for shown in (page, overview):
        for secret in ("pass-in-error", "relay-pass", "redis-pass", "tok-en-secret", TOKEN):
            assert secret not in shown
    assert "mongodb://u:***@db:27017/x" in page and "redis://:***@r:6379/0 down" in page
    assert "amqp://guest:***@rabbit/" in page and "amqp://guest:***@rabbit/" in overview
    assert saved["b"][0].id in page


@pytest.fixture
def forget_secrets() -> Iterator[None]:
    """The command line's registered secrets as they were before the test: ``hide`` keeps
    every secret it sees for the life of the process, and ``static`` or ``value`` would garble
    other tests' texts."""
    from mongo_outbox.cli import common

    before = set(common._SECRETS)
    yield
    common._SECRETS.clear()
    common._SECRETS.update(before)


@pytest.mark.parametrize("password", ["static", "value"])
@pytest.mark.usefixtures("forget_secrets")
async def test_a_secret_that_is_a_word_of_the_page_leaves_the_page_whole(
    client: Any, mongo: MongoServer, db: Any, password: str
) -> None:
    from mongo_outbox.cli.common import Target

    await park(db)
    await db.outbox.update_many(
        {"status": "parked"}, {"$set": {"last_error": f"the {password} was refused"}}
    )
    uri = mongo.uri.replace("mongodb://", f"mongodb://console:{password}@", 1)
    where = Target(uri, db.name, "collection", (), "outbox")
    async with in_process(client, db, mongo, credentials=SIGNED, target=where) as http:
        page = (await http.get("/")).text
        assert 'href="/static/console.css"' in page and 'src="/static/console.js"' in page
        assert "mongodb://console:***@" in page and "the *** was refused" in page
        csrf = csrf_of(page)
        assert len(csrf) > 20  # the token itself, not a redacted stub
        assert (await guess(http, csrf, TOKEN)).status_code == 303
        assert signed_in((await http.get("/")).text)


async def test_reading_needs_a_sign_in_when_required(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    saved = await park(db)
    async with in_process(client, db, mongo, credentials=SIGNED, require_sign_in=True) as http:
        page = await http.get("/")
        assert page.status_code == 401 and 'action="/login"' in page.text
        assert saved["b"][0].id not in page.text and "parked" not in page.text
        for path in ("/api/overview", "/api/history", "/api/outboxes"):
            answer = await http.get(path)
            assert answer.status_code == 401 and answer.json() == {
                "error": "sign in to read this console"
            }
        await sign_in(http)
        assert saved["b"][0].id in (await http.get("/")).text
        assert (await http.get("/api/overview")).json()["parked"] == 4


async def test_beyond_loopback_the_command_shows_nothing_before_a_sign_in(
    mongo: MongoServer, db: Any
) -> None:
    from tests.support.cli import cli

    # Nobody could sign in: refused at start, in one line, before it listens.
    where = [f"--uri={mongo.uri}", f"--db={db.name}", "--port=0", "--host=0.0.0.0"]
    open_to_all = await cli("console", *where)
    assert open_to_all.code == 1 and "--no-require-sign-in" in open_to_all.err
    # On loopback behind a proxy (a name it answers to, or proxies it believes), the same.
    loopback = [*where[:-1], "--host=127.0.0.1"]
    for proxied in ("--allowed-host=console.example", "--trusted-proxies=127.0.0.1"):
        behind = await cli("console", *loopback, proxied)
        assert behind.code == 1 and "--no-require-sign-in" in behind.err, proxied
    env = {"MONGO_OUTBOX_CONSOLE_TOKEN": TOKEN}
    async with served(mongo, db, "--host=0.0.0.0", env=env) as (_, url):
        port = url.rsplit(":", 1)[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            page = await http.get("/")
            assert page.status_code == 401 and 'action="/login"' in page.text
            assert (await http.get("/api/overview")).status_code == 401


async def test_cookies_are_secure_when_asked_or_when_a_trusted_proxy_says_https(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    https = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9"}
    async with in_process(client, db, mongo, secure_cookies=True) as http:
        assert "secure" in (await http.get("/")).headers["set-cookie"].lower()
    async with in_process(client, db, mongo, trusted_proxies=("127.0.0.1",)) as http:
        plain = (await http.get("/")).headers["set-cookie"].lower()
        http.cookies.clear()
        told = (await http.get("/", headers=https)).headers["set-cookie"].lower()
        assert "secure" not in plain and "secure" in told
        # Anyone else saying so is not believed.
        async with visitor(console_of(http), "10.0.0.9") as stranger:
            said = (await stranger.get("/", headers=https)).headers["set-cookie"].lower()
            assert "secure" not in said


async def test_a_trusted_proxy_names_the_client_whose_guesses_are_counted(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    async with in_process(
        client, db, mongo, credentials=SIGNED, trusted_proxies=("127.0.0.1",)
    ) as http:
        csrf = csrf_of((await http.get("/")).text)

        async def guess_from(address: str, token: str) -> int:
            answer = await http.post(
                "/login",
                data={"csrf": csrf, "token": token},
                headers={"X-Forwarded-For": address},
            )
            return answer.status_code

        assert [await guess_from("198.51.100.1", WRONG) for _ in range(6)] == [401] * 5 + [429]
        assert await guess_from("198.51.100.2", TOKEN) == 303


async def test_ten_thousand_requests_without_a_cookie_keep_no_session(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    await park(db)
    async with in_process(client, db, mongo, credentials=SIGNED, require_sign_in=True) as http:
        csrf = await sign_in(http)
        console = console_of(http)
        async with visitor(console) as anonymous:
            for _ in range(10_000):
                anonymous.cookies.clear()
                assert (await anonymous.get("/")).status_code == 401
        assert len(console.sessions) == 1
        page = await http.get("/")
        assert page.status_code == 200 and signed_in(page.text) and csrf_of(page.text) == csrf
    async with in_process(client, db, mongo, credentials=SIGNED) as http:
        for _ in range(5):  # the whole page, read from MongoDB, keeps none either
            http.cookies.clear()
            assert (await http.get("/")).status_code == 200
        assert len(console_of(http).sessions) == 0


async def test_the_sign_out_cookie_is_http_only_and_a_token_of_spaces_is_refused(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    from tests.support.cli import cli, environment

    async with in_process(client, db, mongo, credentials=SIGNED) as http:
        csrf = await sign_in(http)
        out = await http.post("/logout", data={"csrf": csrf})
        cookie = out.headers["set-cookie"].lower()
        assert out.status_code == 303 and cookie.startswith(f"{COOKIE}=")
        assert "httponly" in cookie and "samesite=strict" in cookie and "max-age=0" in cookie
    where = [f"--uri={mongo.uri}", f"--db={db.name}", "--port=0"]
    spaces = await cli("console", *where, env=environment(MONGO_OUTBOX_CONSOLE_TOKEN=" " * 12))
    assert spaces.code == 1 and spaces.err.strip() == (
        "mongo-outbox: MONGO_OUTBOX_CONSOLE_TOKEN must be at least 12 characters long, not "
        "counting whitespace"
    )


@pytest.mark.usefixtures("forget_secrets")
async def test_the_page_tells_no_one_which_guess_holds_a_secret(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    # Redacting the request's own filter told a reader which of thousands of guesses in one
    # query held the token (it came back as ***), with no limit and no log line.
    from mongo_outbox.cli.common import Target

    await park(db)
    uri = mongo.uri.replace("mongodb://", "mongodb://console:s3cret-pw@", 1)
    where = Target(uri, db.name, "collection", (), "outbox")
    guesses = ["s3cret-pw"] + [f"guess-{n}" for n in range(200)]
    async with in_process(client, db, mongo, credentials=SIGNED, target=where) as http:
        await sign_in(http)
        page = (await http.get("/", params={"aggregate": guesses, "type": "s3cret-pw"})).text
    # The request's own words come back as sent; only the URI read from the settings is hidden.
    assert page.count("***") == page.count("mongodb://console:***@")
    assert 'value="s3cret-pw"' in page


async def test_a_form_larger_than_the_limit_is_refused_as_it_arrives(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    from mongo_outbox.cli.console.app import MAX_FORM

    sent = 0

    async def endless() -> Any:
        # A chunked body (no Content-Length) that never ends: read whole before its check,
        # it grew the console's memory without bound.
        nonlocal sent
        while sent < 100 * MAX_FORM:
            sent += 4096
            yield b"x" * 4096

    async with in_process(client, db, mongo, credentials=SIGNED) as http:
        declared = await http.post("/login", content=b"x", headers={"content-length": "999999"})
        assert declared.status_code in (400, 413)
        answer = await http.post("/login", content=endless())
        assert answer.status_code == 413
    assert sent < 100 * MAX_FORM  # refused before the end of the body
