"""The web console's test setup: an outbox with parked events, an inbox with failed messages,
relay and group leases, and the console itself, in process (httpx's ASGI transport, its
lifespan run by hand) or as the real ``mongo-outbox console`` command."""

from __future__ import annotations

import asyncio
import contextlib
import html
import re
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import httpx

from mongo_outbox import (
    Event,
    Inbox,
    Outbox,
    Outcome,
    PoisonMessage,
    PollingRelay,
    RelaySettings,
    inbox_guard,
)
from mongo_outbox.cli.common import Connection, Target
from mongo_outbox.cli.console.app import Console, Settings
from mongo_outbox.cli.console.auth import COOKIE, Credentials, Session
from mongo_outbox.cli.console.data import Places
from mongo_outbox.events import utc_now
from mongo_outbox.publishers import MemoryPublisher
from tests.support.cli import Service, environment
from tests.support.servers import MongoServer

TOKEN = "a-token-of-the-tests-0123456789"
CSRF = re.compile(r'name="csrf" value="([^"]+)"')
HIDDEN = re.compile(r'<input type="hidden" name="([^"]+)" value="([^"]*)">')


async def park(db: Any, mode: str = "collection") -> dict[str, list[Event]]:
    """Order a: a poison event then a good one; b: one "bad" event; c: two poison events.
    Everything but a's good event is parked."""
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    saved: dict[str, list[Event]] = {}
    for doc_id, types in (("a", ["poison", "placed"]), ("b", ["bad"]), ("c", ["poison", "poison"])):
        events = [Event(type=t) for t in types]
        saved[doc_id] = (
            await outbox.save_with_events(None, db.orders, {"_id": doc_id}, events)
        ).events
    broken = MemoryPublisher(
        fail=lambda e: None if e.type == "placed" else ValueError("cannot encode")
    )
    await PollingRelay(outbox, broken, settings=RelaySettings(max_attempts=1)).drain()
    return saved


async def park_one(db: Any, aggregate: str, mode: str = "collection") -> Event:
    """One more parked event, of a new aggregate."""
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    event = Event(type="poison")
    await outbox.save_with_events(None, db.orders, {"_id": aggregate}, [event])
    broken = MemoryPublisher(fail=lambda e: ValueError("cannot encode"))
    await PollingRelay(outbox, broken, settings=RelaySettings(max_attempts=1)).drain()
    return event


async def park_type(db: Any, aggregate: str, type_: str) -> Event:
    """One more parked event, of a new aggregate and of type ``type_`` (its error names it)."""
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    event = Event(type=type_)
    await outbox.save_with_events(None, db.orders, {"_id": aggregate}, [event])
    broken = MemoryPublisher(fail=lambda e: ValueError(f"cannot encode {e.type}"))
    await PollingRelay(outbox, broken, settings=RelaySettings(max_attempts=1)).drain()
    return event


async def dead_letter(db: Any, consumer: str, *events: Event) -> None:
    @inbox_guard(Inbox(db, consumer=consumer, transactional=False))
    async def broken(event: Event, session: Any) -> None:
        raise PoisonMessage("the bug")

    for event in events:
        assert (await broken.handle(event)).outcome is Outcome.DEAD_LETTERED


async def leases(db: Any) -> None:
    """A change-stream relay ``orders`` holding its lease, and relay group ``shop`` of two
    partitions: partition 0 held by member m1, partition 1 by nobody (its member m0 died)."""
    now = utc_now()
    await db.outbox_config.insert_one({"_id": "partitions", "count": 2})
    await db.outbox_relays.insert_many(
        [
            {
                "_id": "orders",
                "owner": "host-a:1",
                "lease_until": now + timedelta(minutes=5),
                "checkpoint_at": now,
            },
            {"_id": "shop/0", "owner": "m1", "lease_until": now + timedelta(minutes=5)},
        ]
    )
    await db.outbox_relay_members.insert_many(
        [
            {
                "_id": "m1",
                "group": "shop",
                "alive_until": now + timedelta(minutes=5),
                "partitions": [0],
            },
            {
                "_id": "m0",
                "group": "shop",
                "alive_until": now - timedelta(minutes=5),
                "partitions": [1],
            },
        ]
    )


def target(mongo: MongoServer, db: Any, mode: str = "collection") -> Target:
    collections = ("orders",) if mode == "embedded" else ()
    return Target(mongo.uri, db.name, mode, collections, "outbox")


@contextlib.asynccontextmanager
async def in_process(
    client: Any,
    db: Any,
    mongo: MongoServer,
    *,
    mode: str = "collection",
    credentials: Credentials | None = None,
    sample_every: float = 5.0,
    databases: tuple[Any, ...] = (),
    **options: Any,
) -> AsyncIterator[httpx.AsyncClient]:
    """The console of ``db``'s outbox (and of ``databases``' too), called in process, from the
    client address 127.0.0.1; its samplers run. ``options`` are more of its ``Settings``."""
    where = options.pop("target", None) or target(mongo, db, mode)
    conns = [Connection(client, d, where.outbox(d)) for d in (db, *databases)]
    settings = Settings(
        target=where,
        places=Places(),
        credentials=credentials or Credentials(),
        sample_every=sample_every,
        **options,
    )
    console = Console(conns, settings)
    app = console.app
    async with app.router.lifespan_context(app):
        async with visitor(console) as http:
            yield http


@contextlib.asynccontextmanager
async def visitor(
    console: Console, address: str = "127.0.0.1", base_url: str = "http://127.0.0.1"
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``console`` (its lifespan already running) from ``address``, with cookies
    of its own."""
    transport = httpx.ASGITransport(app=console.app, client=(address, 50000))
    async with httpx.AsyncClient(transport=transport, base_url=base_url) as http:
        CONSOLES[id(http)] = console
        try:
            yield http
        finally:
            del CONSOLES[id(http)]


CONSOLES: dict[int, Console] = {}


def console_of(http: httpx.AsyncClient) -> Console:
    return CONSOLES[id(http)]


def session_of(http: httpx.AsyncClient) -> Session:
    """The console's session of this client's cookie: signed in, or a visitor's (kept
    nowhere, its CSRF token derived from its id)."""
    cookie = http.cookies.get(COOKIE)
    assert cookie, "no cookie"
    return CONSOLES[id(http)].sessions.of(cookie)[0]


def csrf_of(page: str) -> str:
    found = CSRF.search(page)
    assert found, "no CSRF field on the page"
    return found.group(1)


def hidden_fields(page: str) -> list[tuple[str, str]]:
    """The hidden fields of a page's forms, as the browser would send them."""
    return [(html.unescape(name), html.unescape(value)) for name, value in HIDDEN.findall(page)]


async def confirmed(http: httpx.AsyncClient, path: str, form: dict[str, Any]) -> httpx.Response:
    """POST a requeue of everything, find its confirm page (asked before anything is done),
    and send that page's form, as an operator clicking "Requeue" there would."""
    asked = await http.post(path, data=form)
    assert asked.status_code == 200 and 'id="confirm-form"' in asked.text, asked.text
    return await post_form(http, path, hidden_fields(asked.text))


async def post_form(
    http: httpx.AsyncClient, path: str, fields: list[tuple[str, str]]
) -> httpx.Response:
    """POST ``fields`` as a browser sends a form: in their order, a name as often as it comes."""
    body = urlencode(fields)
    kind = {"content-type": "application/x-www-form-urlencoded"}
    return await http.post(path, content=body, headers=kind)


async def sign_in(http: httpx.AsyncClient, token: str = TOKEN) -> str:
    """Sign in with ``token``; return the signed-in session's CSRF token."""
    page = await http.get("/")
    answer = await http.post("/login", data={"csrf": csrf_of(page.text), "token": token})
    assert answer.status_code == 303, answer.text
    return csrf_of((await http.get("/")).text)


@contextlib.asynccontextmanager
async def served(
    mongo: MongoServer,
    db: Any,
    *args: str,
    env: dict[str, str] | None = None,
    uri: str | None = None,
) -> AsyncIterator[tuple[Service, str]]:
    """``mongo-outbox console`` on a free port (of ``uri``'s MongoDB, the test one's by
    default): the service and the URL it printed."""
    where = [] if any(a.startswith("--databases") for a in args) else [f"--db={db.name}"]
    service = Service(
        "console",
        f"--uri={uri or mongo.uri}",
        *where,
        "--port=0",
        *args,
        env=environment(**(env or {})),
    )
    await service.start()
    try:
        assert service.process is not None and service.process.stdout is not None
        line = await asyncio.wait_for(service.process.stdout.readline(), 30)
        if not line:
            ran = await service.stop(0)
            raise AssertionError(f"the console exited {ran.code}: {ran.output}")
        url = line.decode().split(" at ", 1)[1].split()[0]
        yield service, url
    finally:
        service.kill()
        if service.process is not None:
            await service.process.wait()
