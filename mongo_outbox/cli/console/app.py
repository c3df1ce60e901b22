"""The console's web application: a Starlette app that renders one page on the server, JSON
endpoints the page's script polls, and the two actions (requeue parked events, requeue failed
inbox messages), each a plain HTML form.

It serves one outbox, or one per database (``--databases``, tenants): the page lists each
one's backlog, and shows the details (chart, relays, parked events, inbox) of the one chosen
with ``?db=``.

Every request's ``Host`` must be an allowed name (``hosts.py``). Every POST passes three
checks, in this order: the session's CSRF token (``auth.py``), then a signed-in session, then the
action's own fields; a sign-in takes its place among the limited guesses (``limits.py``) before
its answer is checked. With ``require_sign_in``, nothing is read for a visitor who is not signed
in. Without configured credentials nobody can sign in, and the page says the console is
read-only. Responses forbid framing (a hidden frame could make an operator click "requeue") and
allow scripts and styles from the console only. The data a page or a JSON answer shows is
redacted before it is rendered (``redaction.py``): no credential is ever shown.

A page tells what it could not read: when MongoDB does not answer, the page says so on top and
shows no number in place of those it could not read; each part read when the page was made
carries its time, and its script marks it stale once the live numbers moved on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlencode

import jinja2
from pymongo.errors import PyMongoError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from mongo_outbox.cli.common import Connection, Target, age, hide, one_line
from mongo_outbox.cli.console import data
from mongo_outbox.cli.console.auth import COOKIE, SESSION_LIFETIME, Credentials, Session, Sessions
from mongo_outbox.cli.console.hosts import HostCheck, allowed_hosts
from mongo_outbox.cli.console.limits import OVERALL, PER_CLIENT, Rate, SignInLimit, retry_after
from mongo_outbox.cli.console.redaction import redacted
from mongo_outbox.errors import OutboxError
from mongo_outbox.events import as_utc, utc_now

log = logging.getLogger("mongo_outbox.cli")
T = TypeVar("T")

HERE = Path(__file__).parent
MAX_FORM = 64 * 1024
"""Bytes a form may have: a requeue of every shown event fits many times over."""
READ_TIMEOUT = 10.0
"""Seconds the reads of one page or one JSON answer may take: a MongoDB that stopped answering
(a connection hung without a reset) shows as an outage, not as a page that never comes. A
MongoDB that refuses connections fails sooner, at the client's server selection timeout (3 s)."""
READ_ONLY = "the console is read-only: no credentials are configured"
SIGN_IN_TO_READ = "sign in to read this console"

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class Settings:
    """What the console serves: the outbox (``target``), the collections beside it, who may
    act, the host it listens on and the other names it answers to (``allowed_hosts``), whether
    reading needs a sign-in, its cookies' ``Secure`` (always, or when a trusted proxy says the
    request came over HTTPS), the proxies whose ``X-Forwarded-For`` and ``X-Forwarded-Proto``
    it believes, the sign-in guesses it checks, and the chart's sampling."""

    target: Target
    places: data.Places
    credentials: Credentials
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    require_sign_in: bool = False
    secure_cookies: bool = False
    trusted_proxies: tuple[str, ...] = ()
    guesses_per_client: Rate = PER_CLIENT
    guesses_overall: Rate = OVERALL
    read_timeout: float = READ_TIMEOUT
    sample_every: float = 5.0
    samples_kept: int = 180


class Refused(Exception):
    """An action refused: its status code and the reason shown."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Unread(Exception):
    """What a page or an answer needed could not be read from MongoDB; the message says why."""


def create_app(conns: Sequence[Connection], settings: Settings) -> Starlette:
    """The console of the outboxes of ``conns`` (one per database). Its lifespan runs the
    chart's samplers."""
    return Console(conns, settings).app


class Console:
    def __init__(self, conns: Sequence[Connection], settings: Settings) -> None:
        self.conns = {conn.db.name: conn for conn in conns}
        self.settings = settings
        self.credentials = settings.credentials
        self.sessions = Sessions()
        self.guesses = SignInLimit(settings.guesses_per_client, settings.guesses_overall)
        self.samplers = {
            name: data.Sampler(conn, settings.sample_every, settings.samples_kept)
            for name, conn in self.conns.items()
        }
        self.shown_uri = hide(settings.target.uri)
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.templates.filters["age"] = _age
        self.templates.filters["when"] = _when
        self.app = Starlette(
            routes=[
                Route("/", self.page),
                Route("/api/overview", self.overview_json),
                Route("/api/history", self.history_json),
                Route("/api/outboxes", self.outboxes_json),
                Route("/login", self.login, methods=["POST"]),
                Route("/logout", self.logout, methods=["POST"]),
                Route("/parked/requeue", self.requeue_parked, methods=["POST"]),
                Route("/inbox/requeue", self.requeue_failed, methods=["POST"]),
                Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
            ],
            lifespan=self._lifespan,
        )
        self.app.add_middleware(
            HostCheck, allowed=allowed_hosts(settings.host, settings.allowed_hosts)
        )
        if settings.trusted_proxies:
            # Outermost: the client's address and scheme are the proxy's word for them, for
            # the sign-in limit, the logs and the cookies' Secure.
            from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

            self.app.add_middleware(
                ProxyHeadersMiddleware, trusted_hosts=list(settings.trusted_proxies)
            )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for sampler in self.samplers.values():
                await stack.enter_async_context(data.sampling(sampler))
            yield

    # -- rendering --------------------------------------------------------------------------

    def _shown(self, value: Any) -> Any:
        """``value`` as it may be shown: every text in it redacted."""
        return redacted(value, self.credentials.secrets)

    def _cookie_secure(self, request: Request) -> bool:
        # request.url.scheme is https only when a trusted proxy said so (X-Forwarded-Proto):
        # the console itself speaks plain HTTP.
        return self.settings.secure_cookies or request.url.scheme == "https"

    def _finish(
        self, request: Request, response: Response, session: Session | None, fresh: bool
    ) -> Response:
        for name, value in HEADERS.items():
            response.headers[name] = value
        if session is not None and fresh:
            response.set_cookie(
                COOKIE,
                session.id,
                max_age=int(SESSION_LIFETIME),
                httponly=True,
                samesite="strict",
                secure=self._cookie_secure(request),
                path="/",
            )
        return response

    def _json(self, request: Request, content: Any, status: int = 200) -> Response:
        # Through JSON first, so that whatever json.dumps would turn into text (a time, an
        # ObjectId) is text when it is redacted.
        plain = json.loads(json.dumps(content, default=str, ensure_ascii=False))
        text = json.dumps(self._shown(plain), ensure_ascii=False)
        response = Response(text, status, media_type="application/json")
        return self._finish(request, response, None, False)

    def _session(self, request: Request) -> tuple[Session, bool]:
        return self.sessions.of(request.cookies.get(COOKIE))

    def _may_read(self, request: Request) -> bool:
        if not self.settings.require_sign_in:
            return True
        return self.sessions.get(request.cookies.get(COOKIE)) is not None

    def _conn(self, name: str | None) -> Connection:
        """The chosen database's connection (the first one by default), else ``Refused``."""
        if not name:
            return next(iter(self.conns.values()))
        if name not in self.conns:
            raise Refused(404, "this console serves no such database")
        return self.conns[name]

    async def _read(self, reads: Awaitable[T]) -> T:
        """What ``reads`` read, within the read timeout, else ``Unread`` saying why.

        A timeout of asyncio's, not PyMongo's: PyMongo's would also stretch its server
        selection to the whole timeout, and a MongoDB that refuses connections would take
        that long to show as down."""
        try:
            return await asyncio.wait_for(reads, self.settings.read_timeout)
        except (OutboxError, PyMongoError) as problem:
            raise Unread(one_line(problem)) from None
        except asyncio.TimeoutError:
            raise Unread(f"no answer within {self.settings.read_timeout:g} s") from None

    def _render(self, name: str, **context: Any) -> str:
        return self.templates.get_template(name).render(**context)

    async def page(self, request: Request) -> Response:
        session, fresh = self._session(request)
        common = {
            "csrf": session.csrf,
            "configured": self.credentials.configured,
            "token_login": self.credentials.token is not None,
            "password_login": self.credentials.password is not None,
        }
        if not session.signed_in and self.settings.require_sign_in:
            html = self._render("sign-in.html", **common)
            return self._finish(request, HTMLResponse(html, 401), session, fresh)
        params = request.query_params
        types = [t for t in params.getlist("type") if t]
        aggregates = [a for a in params.getlist("aggregate") if a]
        after = params.get("after") or None
        try:
            conn = self._conn(params.get("db"))
        except Refused as refused:
            return self._refused(request, refused)
        target, places = self.settings.target, self.settings.places
        read_at = utc_now()

        async def read() -> dict[str, Any]:
            outboxes = []
            if len(self.conns) > 1:  # each one's backlog, on top of the chosen one's details
                outboxes = [await data.backlog(c) for c in self.conns.values()]
            overview = await data.overview(conn, target, places)
            page = await data.parked(conn, types, aggregates, after)
            failed = await data.inbox_failures(conn, places)
            more = {"db": conn.db.name, "type": types, "aggregate": aggregates}
            return {
                "outboxes": outboxes,
                "overview": overview,
                "parked": {
                    "entries": [data.parked_row(entry) for entry in page.entries],
                    "total": page.total,
                    "matching": page.matching,
                    "types": list(page.types),
                    "after": after,
                    "next": (
                        None
                        if page.next_after is None
                        else urlencode({**more, "after": page.next_after}, doseq=True)
                    ),
                },
                "failed": [data.failed_row(record) for record in failed],
                "error": None,
            }

        try:
            found = await self._read(read())
        except Unread as problem:
            # Nothing read, nothing shown: the parts it could not read are said to be unread,
            # never shown as zeros.
            found = {"outboxes": [], "overview": None, "parked": None, "failed": None}
            found["error"] = str(problem)
        notice, session.notice = session.notice, None
        # What was read is redacted; what the request itself sent is shown as sent (escaped):
        # redacted, it told whoever asked whether a guess held a secret (a query of thousands of
        # guesses marked the right ones), unlimited and unlogged.
        shown = {
            **self._shown({**found, "db": conn.db.name, "notice": notice}),
            "types": types,
            "aggregates": aggregates,
        }
        error = found["error"]
        html = self._render(
            "page.html",
            **common,
            **shown,
            uri=self.shown_uri,
            read_at=read_at,
            relays_signature=_signature(shown["overview"]),
            signed_in=session.signed_in,
            sample_every=self.settings.sample_every,
        )
        response = HTMLResponse(html, 503 if error else 200)
        return self._finish(request, response, session, fresh)

    async def overview_json(self, request: Request) -> Response:
        if not self._may_read(request):
            return self._json(request, {"error": SIGN_IN_TO_READ}, 401)
        try:
            conn = self._conn(request.query_params.get("db"))
            places = self.settings.places
            report = await self._read(data.overview(conn, self.settings.target, places))
        except Refused as refused:
            return self._json(request, {"error": refused.reason}, refused.status)
        except Unread as problem:
            return self._json(request, {"error": str(problem)}, 503)
        return self._json(request, report)

    async def outboxes_json(self, request: Request) -> Response:
        """Each outbox's backlog: the table of ``--databases``, read at once."""
        if not self._may_read(request):
            return self._json(request, {"error": SIGN_IN_TO_READ}, 401)

        async def read() -> list[dict[str, Any]]:
            return [await data.backlog(c) for c in self.conns.values()]

        try:
            rows = await self._read(read())
        except Unread as problem:
            return self._json(request, {"error": str(problem)}, 503)
        return self._json(request, {"outboxes": rows})

    async def history_json(self, request: Request) -> Response:
        if not self._may_read(request):
            return self._json(request, {"error": SIGN_IN_TO_READ}, 401)
        try:
            conn = self._conn(request.query_params.get("db"))
        except Refused as refused:
            return self._json(request, {"error": refused.reason}, refused.status)
        return self._json(request, self.samplers[conn.db.name].history())

    # -- actions ----------------------------------------------------------------------------

    async def _form(
        self, request: Request, *, signed_in: bool
    ) -> tuple[Session, dict[str, list[str]]]:
        """The POST's session and fields, once its CSRF token (and, if asked, its sign-in)
        passed: else ``Refused``."""
        body = await _bounded_body(request)
        kind = request.headers.get("content-type", "").split(";")[0].strip()
        if kind not in ("application/x-www-form-urlencoded", ""):
            raise Refused(415, "send the form as application/x-www-form-urlencoded")
        fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        cookie = request.cookies.get(COOKIE)
        if not cookie:
            raise Refused(403, "no session: reload the page and try again")
        session, _ = self.sessions.of(cookie)
        if not session.check(_field(fields, "csrf")):
            raise Refused(403, "the form's CSRF token is missing or wrong: reload the page")
        if signed_in and not self.credentials.configured:
            raise Refused(403, READ_ONLY)
        if signed_in and not session.signed_in:
            raise Refused(401, "sign in to act")
        return session, fields

    def _refused(
        self, request: Request, refused: Refused, headers: dict[str, str] | None = None
    ) -> Response:
        client = request.client.host if request.client else "?"
        reason = self._shown(refused.reason)
        log.warning(
            "console: refused %s %s from %s: %s", request.method, request.url.path, client, reason
        )
        html = self._render("refused.html", reason=reason)
        response = HTMLResponse(html, refused.status, headers=headers)
        return self._finish(request, response, None, False)

    def _back(self, request: Request, fields: dict[str, list[str]]) -> Response:
        db = _field(fields, "db")
        where = "/?" + urlencode({"db": db}) if db else "/"
        return self._finish(request, RedirectResponse(where, 303), None, False)

    async def _act(
        self,
        request: Request,
        action: Callable[[Connection, dict[str, list[str]]], Awaitable[str]],
    ) -> Response:
        try:
            session, fields = await self._form(request, signed_in=True)
            notice = await action(self._conn(_field(fields, "db")), fields)
        except Refused as refused:
            return self._refused(request, refused)
        except (OutboxError, PyMongoError) as problem:
            return self._refused(request, Refused(503, one_line(problem)))
        log.info("console: %s", self._shown(notice))
        session.notice = notice
        return self._back(request, fields)

    async def login(self, request: Request) -> Response:
        try:
            session, fields = await self._form(request, signed_in=False)
            if not self.credentials.configured:
                raise Refused(403, READ_ONLY)
            # The guess takes its place before its answer is checked, with no await between
            # the two: guesses sent at once are refused unchecked once the places are taken.
            wait = self.guesses.take(request.client.host if request.client else "")
            if wait:
                refused = Refused(429, "too many sign-in attempts: try again later")
                return self._refused(request, refused, {"Retry-After": retry_after(wait)})
            answers = (_field(fields, "token"), _field(fields, "user"), _field(fields, "password"))
            if not self.credentials.accept(*answers):
                raise Refused(401, "wrong credentials")
        except Refused as refused:
            return self._refused(request, refused)
        # A new id on signing in: an id someone planted before is worth nothing now.
        self.sessions.end(session)
        signed = self.sessions.sign_in()
        signed.notice = "signed in"
        response = self._back(request, fields)
        return self._finish(request, response, signed, True)

    async def logout(self, request: Request) -> Response:
        try:
            session, fields = await self._form(request, signed_in=False)
        except Refused as refused:
            return self._refused(request, refused)
        self.sessions.end(session)
        response = self._back(request, fields)
        response.delete_cookie(
            COOKIE,
            path="/",
            httponly=True,
            samesite="strict",
            secure=self._cookie_secure(request),
        )
        return response

    async def requeue_parked(self, request: Request) -> Response:
        async def action(conn: Connection, fields: dict[str, list[str]]) -> str:
            if _field(fields, "matching") == "1":
                # Every parked event the page's filters keep, as parked requeue --type
                # --aggregate (or --all, with no filter) does.
                types = [t for t in fields.get("type", []) if t]
                aggregates = [a for a in fields.get("aggregate", []) if a]
                ids = await data.matching(conn, types, aggregates)
                if not ids:
                    return "no parked event matches: nothing was requeued"
            else:
                ids = [i for i in fields.get("event_id", []) if i]
                if not ids:
                    raise Refused(400, "choose the parked events to requeue")
            requeued = await data.requeue_parked(conn, ids)
            earlier = requeued - len(ids)
            if earlier < 0:
                return f"requeued {requeued} of {len(ids)} events: the rest are no longer parked"
            also = f", and {earlier} earlier parked events of their aggregates" if earlier else ""
            return f"requeued {len(ids)} parked events{also}"

        return await self._act(request, action)

    async def requeue_failed(self, request: Request) -> Response:
        async def action(conn: Connection, fields: dict[str, list[str]]) -> str:
            consumer = _field(fields, "consumer")
            if not consumer:
                raise Refused(400, "name the consumer")
            ids = [i for i in fields.get("message_id", []) if i]
            everything = _field(fields, "all") == "1"
            if not ids and not everything:
                raise Refused(400, "choose the failed messages to requeue")
            chosen = None if everything else ids
            count = await data.requeue_failed(conn, self.settings.places, consumer, chosen)
            return (
                f"requeued {count} failed messages of {consumer}: their next delivery runs the "
                "handler again"
            )

        return await self._act(request, action)


def _signature(overview: dict[str, Any] | None) -> str:
    """The relays and partitions shown, as one text: the page's script builds the same from
    the live overview, and marks the relays stale when the two differ."""
    if overview is None:
        return ""
    rows = ["|".join(_text(r["name"], r["state"], r["lease_holder"])) for r in overview["relays"]]
    for group in overview["groups"]:
        for p in group["partitions"]:
            rows.append(
                "|".join(_text(group["name"], p["partition"], p["state"], p["lease_holder"]))
            )
    return ";".join(rows)


def _text(*values: Any) -> list[str]:
    return ["" if value is None else str(value) for value in values]


def _field(fields: dict[str, list[str]], name: str) -> str:
    return (fields.get(name) or [""])[0]


def _age(seconds: float | None) -> str:
    return age(None if seconds is None else timedelta(seconds=seconds))


def _when(at: Any) -> str:
    if not isinstance(at, datetime):
        return "-" if at is None else str(at)
    return as_utc(at).strftime("%Y-%m-%d %H:%M:%S UTC")


async def _bounded_body(request: Request) -> bytes:
    """The request's body, refused (413) past ``MAX_FORM`` as it arrives: read whole first
    (``request.body()``), a chunked body of any size was held in memory before any check."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_FORM:
        raise Refused(413, "the form is too large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            raise Refused(413, "the form is too large")
    return bytes(body)
