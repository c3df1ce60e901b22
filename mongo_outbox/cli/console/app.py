"""The console's web application: a Starlette app that renders one page on the server, JSON
endpoints the page's script polls, and the two actions (requeue parked events, requeue failed
inbox messages), each a plain HTML form.

It serves one outbox, or one per database (``--databases``, tenants): the page lists each
one's backlog, and shows the details (chart, relays, parked events, inbox) of the one chosen
with ``?db=``.

Every POST passes three checks, in this order: the session's CSRF token (``auth.py``), then a
signed-in session, then the action's own fields. Without configured credentials nobody can sign
in, and the page says the console is read-only. Responses forbid framing (a hidden frame could
make an operator click "requeue") and allow scripts and styles from the console only. What the
page and the JSON show passes through the command line's ``scrub``, and the console's own
secrets are replaced as well: no credential is ever rendered.
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
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import jinja2
from pymongo.errors import PyMongoError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from mongo_outbox._relay.store.base import ParkedChoice
from mongo_outbox.cli.common import Connection, Target, age, hide, one_line, scrub
from mongo_outbox.cli.console import data
from mongo_outbox.cli.console.auth import COOKIE, SESSION_LIFETIME, Credentials, Session, Sessions
from mongo_outbox.errors import OutboxError
from mongo_outbox.events import as_utc

log = logging.getLogger("mongo_outbox.cli")

HERE = Path(__file__).parent
MAX_FORM = 64 * 1024
"""Bytes a form may have: a requeue of every shown event fits many times over."""
SIGN_IN_PAUSE = 1.0
"""Seconds a wrong sign-in waits before its answer, one at a time: guesses are slow."""
READ_ONLY = "the console is read-only: no credentials are configured"
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})

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
    act, the host it listens on (for the Host check), and the chart's sampling."""

    target: Target
    places: data.Places
    credentials: Credentials
    host: str = "127.0.0.1"
    sample_every: float = 5.0
    samples_kept: int = 180


class Refused(Exception):
    """An action refused: its status code and the reason shown."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def create_app(conns: Sequence[Connection], settings: Settings) -> Starlette:
    """The console of the outboxes of ``conns`` (one per database). Its lifespan runs the
    chart's samplers."""
    return Console(conns, settings).app


class LoopbackOnly:
    """Refuses a request whose ``Host`` is not a loopback name. A site whose name was made to
    resolve to 127.0.0.1 (DNS rebinding) would be of the console's origin and could read it;
    the Host its requests carry gives it away."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if urlsplit(f"//{host}").hostname not in LOOPBACK:
                refused = PlainTextResponse("this console answers to 127.0.0.1 only", 400)
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Console:
    def __init__(self, conns: Sequence[Connection], settings: Settings) -> None:
        self.conns = {conn.db.name: conn for conn in conns}
        self.settings = settings
        self.credentials = settings.credentials
        self.sessions = Sessions()
        self._signing_in = asyncio.Lock()
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
                Route("/login", self.login, methods=["POST"]),
                Route("/logout", self.logout, methods=["POST"]),
                Route("/parked/requeue", self.requeue_parked, methods=["POST"]),
                Route("/inbox/requeue", self.requeue_failed, methods=["POST"]),
                Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
            ],
            lifespan=self._lifespan,
        )
        if urlsplit(f"//{settings.host}").hostname in LOOPBACK or settings.host in LOOPBACK:
            self.app.add_middleware(LoopbackOnly)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for sampler in self.samplers.values():
                await stack.enter_async_context(data.sampling(sampler))
            yield

    # -- rendering --------------------------------------------------------------------------

    def _clean(self, text: str) -> str:
        text = scrub(text)
        for secret in self.credentials.secrets:
            text = text.replace(secret, "***")
        return text

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
                # Behind a proxy that terminates TLS (and says so), the cookie never travels
                # in clear.
                secure=request.url.scheme == "https",
                path="/",
            )
        return response

    def _json(self, request: Request, content: Any, status: int = 200) -> Response:
        text = self._clean(json.dumps(content, default=str, ensure_ascii=False))
        response = Response(text, status, media_type="application/json")
        return self._finish(request, response, None, False)

    def _session(self, request: Request) -> tuple[Session, bool]:
        found = self.sessions.get(request.cookies.get(COOKIE))
        return (found, False) if found else (self.sessions.new(), True)

    def _conn(self, name: str | None) -> Connection:
        """The chosen database's connection (the first one by default), else ``Refused``."""
        if not name:
            return next(iter(self.conns.values()))
        if name not in self.conns:
            raise Refused(404, "this console serves no such database")
        return self.conns[name]

    async def page(self, request: Request) -> Response:
        session, fresh = self._session(request)
        params = request.query_params
        types = [t for t in params.getlist("type") if t]
        aggregates = [a for a in params.getlist("aggregate") if a]
        try:
            conn = self._conn(params.get("db"))
        except Refused as refused:
            return self._refused(request, refused)
        target, places = self.settings.target, self.settings.places
        try:
            outboxes = []
            if len(self.conns) > 1:  # each one's backlog, on top of the chosen one's details
                outboxes = [await data.overview(c, target, places) for c in self.conns.values()]
            overview = await data.overview(conn, target, places)
            parked = await data.parked(conn, types, aggregates)
            failed = await data.inbox_failures(conn, places)
            error = None
        except (OutboxError, PyMongoError) as problem:
            outboxes, overview, failed, error = [], None, [], one_line(problem)
            parked = ParkedChoice([], [], [])
        notice, session.notice = session.notice, None
        html = self.templates.get_template("page.html").render(
            uri=self.shown_uri,
            db=conn.db.name,
            outboxes=outboxes,
            overview=overview,
            error=error,
            parked=parked.entries,
            parked_total=len(parked.keys),
            parked_matching=len(parked.chosen),
            parked_types=sorted({str(key.type) for key in parked.keys}),
            types=types,
            aggregates=aggregates,
            failed=failed,
            configured=self.credentials.configured,
            token_login=self.credentials.token is not None,
            password_login=self.credentials.password is not None,
            signed_in=session.signed_in,
            csrf=session.csrf,
            notice=notice,
            sample_every=self.settings.sample_every,
        )
        response = HTMLResponse(self._clean(html), 503 if error else 200)
        return self._finish(request, response, session, fresh)

    async def overview_json(self, request: Request) -> Response:
        try:
            conn = self._conn(request.query_params.get("db"))
            report = await data.overview(conn, self.settings.target, self.settings.places)
        except Refused as refused:
            return self._json(request, {"error": refused.reason}, refused.status)
        except (OutboxError, PyMongoError) as problem:
            return self._json(request, {"error": one_line(problem)}, 503)
        return self._json(request, report)

    async def history_json(self, request: Request) -> Response:
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
        body = await request.body()
        if len(body) > MAX_FORM:
            raise Refused(413, "the form is too large")
        kind = request.headers.get("content-type", "").split(";")[0].strip()
        if kind not in ("application/x-www-form-urlencoded", ""):
            raise Refused(415, "send the form as application/x-www-form-urlencoded")
        fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        session = self.sessions.get(request.cookies.get(COOKIE))
        if session is None:
            raise Refused(403, "no session: reload the page and try again")
        if not session.check(_field(fields, "csrf")):
            raise Refused(403, "the form's CSRF token is missing or wrong: reload the page")
        if signed_in and not self.credentials.configured:
            raise Refused(403, READ_ONLY)
        if signed_in and not session.signed_in:
            raise Refused(401, "sign in to act")
        return session, fields

    def _refused(self, request: Request, refused: Refused) -> Response:
        client = request.client.host if request.client else "?"
        log.warning(
            "console: refused %s %s from %s: %s",
            request.method,
            request.url.path,
            client,
            refused.reason,
        )
        html = self.templates.get_template("refused.html").render(reason=refused.reason)
        return self._finish(request, HTMLResponse(html, refused.status), None, False)

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
        log.info("console: %s", notice)
        session.notice = notice
        return self._back(request, fields)

    async def login(self, request: Request) -> Response:
        try:
            session, fields = await self._form(request, signed_in=False)
            if not self.credentials.configured:
                raise Refused(403, READ_ONLY)
            answers = (_field(fields, "token"), _field(fields, "user"), _field(fields, "password"))
            if not self.credentials.accept(*answers):
                # Wrong answers wait their turn, one a second: guessing stays slow, and a queue
                # of them cannot hold up a right one (checked before it, outside the queue).
                async with self._signing_in:
                    await asyncio.sleep(SIGN_IN_PAUSE)
                raise Refused(401, "wrong credentials")
        except Refused as refused:
            return self._refused(request, refused)
        # A new id on signing in: an id someone planted before is worth nothing now.
        self.sessions.end(session)
        signed = self.sessions.new(signed_in=True)
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
        response.delete_cookie(COOKIE, path="/")
        return response

    async def requeue_parked(self, request: Request) -> Response:
        async def action(conn: Connection, fields: dict[str, list[str]]) -> str:
            if _field(fields, "matching") == "1":
                # Every parked event the page's filters keep, as parked requeue --type
                # --aggregate (or --all, with no filter) does.
                types = [t for t in fields.get("type", []) if t]
                aggregates = [a for a in fields.get("aggregate", []) if a]
                ids = (await data.parked(conn, types, aggregates, read=0)).chosen
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


def _field(fields: dict[str, list[str]], name: str) -> str:
    return (fields.get(name) or [""])[0]


def _age(seconds: float | None) -> str:
    return age(None if seconds is None else timedelta(seconds=seconds))


def _when(at: Any) -> str:
    if not isinstance(at, datetime):
        return "-" if at is None else str(at)
    return as_utc(at).strftime("%Y-%m-%d %H:%M:%S UTC")
