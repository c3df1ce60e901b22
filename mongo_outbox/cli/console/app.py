"""The console's web application: a Starlette app that renders one page on the server, a JSON
endpoint the page's chart polls, and the two actions (requeue parked events, requeue failed
inbox messages), each a plain HTML form.

Every POST passes three checks, in this order: the session's CSRF token (``auth.py``), then a
signed-in session, then the action's own fields. Without configured credentials nobody can sign
in, and the page says the console is read-only. Responses forbid framing (a hidden frame could
make an operator click "requeue") and allow scripts and styles from the console only. What the
page and the JSON show passes through the command line's ``scrub``, and the console's own
secrets are replaced as well: no credential is ever rendered.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import jinja2
from pymongo.errors import PyMongoError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from mongo_outbox.cli.common import Connection, Target, age, hide, one_line, scrub
from mongo_outbox.cli.console import data
from mongo_outbox.cli.console.auth import COOKIE, SESSION_LIFETIME, Credentials, Session, Sessions
from mongo_outbox.errors import OutboxError
from mongo_outbox.events import as_utc

log = logging.getLogger("mongo_outbox.cli")

HERE = Path(__file__).parent
MAX_FORM = 64 * 1024
"""Bytes a form may have: a requeue of every shown event fits many times over."""
READ_ONLY = "the console is read-only: no credentials are configured"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")

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


def create_app(conn: Connection, settings: Settings) -> Starlette:
    """The console of ``conn``'s outbox. Its lifespan runs the chart's sampler."""
    return Console(conn, settings).app


class Console:
    def __init__(self, conn: Connection, settings: Settings) -> None:
        self.conn = conn
        self.settings = settings
        self.credentials = settings.credentials
        self.sessions = Sessions()
        self.sampler = data.Sampler(conn, settings.sample_every, settings.samples_kept)
        self.shown_uri = hide(settings.target.uri)
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.templates.filters["age"] = _age
        self.templates.filters["when"] = _when
        middleware = []
        if settings.host in LOOPBACK:
            # A site whose name was made to resolve to 127.0.0.1 (DNS rebinding) would be of
            # the console's origin and could read it: the Host it sends gives it away.
            hosts = ["127.0.0.1", "localhost", "[::1]", "::1", "testserver"]
            middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=hosts))
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
            middleware=middleware,
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with data.sampling(self.sampler):
            yield

    # -- rendering --------------------------------------------------------------------------

    def _clean(self, text: str) -> str:
        text = scrub(text)
        for secret in self.credentials.secrets:
            text = text.replace(secret, "***")
        return text

    def _finish(self, response: Response, session: Session | None, fresh: bool) -> Response:
        for name, value in HEADERS.items():
            response.headers[name] = value
        if session is not None and fresh:
            response.set_cookie(
                COOKIE,
                session.id,
                max_age=int(SESSION_LIFETIME),
                httponly=True,
                samesite="strict",
                secure=False,
                path="/",
            )
        return response

    def _json(self, content: Any, status: int = 200) -> Response:
        text = self._clean(json.dumps(content, default=str, ensure_ascii=False))
        return self._finish(Response(text, status, media_type="application/json"), None, False)

    def _session(self, request: Request) -> tuple[Session, bool]:
        found = self.sessions.get(request.cookies.get(COOKIE))
        return (found, False) if found else (self.sessions.new(), True)

    async def page(self, request: Request) -> Response:
        session, fresh = self._session(request)
        types = [t for t in request.query_params.getlist("type") if t]
        aggregates = [a for a in request.query_params.getlist("aggregate") if a]
        try:
            overview = await data.overview(self.conn, self.settings.target, self.settings.places)
            entries = await data.parked(self.conn)
            failed = await data.inbox_failures(self.conn, self.settings.places)
            error = None
        except (OutboxError, PyMongoError) as problem:
            overview, entries, failed, error = None, [], [], one_line(problem)
        chosen = [e for e in entries if data.matches(e, types, aggregates)]
        notice, session.notice = session.notice, None
        html = self.templates.get_template("page.html").render(
            uri=self.shown_uri,
            overview=overview,
            error=error,
            parked=chosen[: data.SHOWN],
            parked_total=len(entries),
            parked_matching=len(chosen),
            parked_types=sorted({str(e.get("type")) for e in entries}),
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
        return self._finish(HTMLResponse(self._clean(html), 503 if error else 200), session, fresh)

    async def overview_json(self, request: Request) -> Response:
        try:
            report = await data.overview(self.conn, self.settings.target, self.settings.places)
        except (OutboxError, PyMongoError) as problem:
            return self._json({"error": one_line(problem)}, 503)
        return self._json(report)

    async def history_json(self, request: Request) -> Response:
        return self._json(self.sampler.history())

    # -- actions ----------------------------------------------------------------------------

    async def _form(
        self, request: Request, *, signed_in: bool
    ) -> tuple[Session, dict[str, list[str]]]:
        """The POST's session and fields, once its CSRF token (and, if asked, its sign-in)
        passed: else ``Refused``."""
        body = await request.body()
        if len(body) > MAX_FORM:
            raise Refused(413, "the form is too large")
        if request.headers.get("content-type", "").split(";")[0].strip() not in (
            "application/x-www-form-urlencoded",
            "",
        ):
            raise Refused(415, "send the form as application/x-www-form-urlencoded")
        fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        session = self.sessions.get(request.cookies.get(COOKIE))
        if session is None:
            raise Refused(403, "no session: reload the page and try again")
        if not session.check((fields.get("csrf") or [""])[0]):
            raise Refused(403, "the form's CSRF token is missing or wrong: reload the page")
        if signed_in and not self.credentials.configured:
            raise Refused(403, READ_ONLY)
        if signed_in and not session.signed_in:
            raise Refused(401, "sign in to act")
        return session, fields

    def _refused(self, refused: Refused) -> Response:
        log.warning("console: refused: %s", refused.reason)
        html = self.templates.get_template("refused.html").render(reason=refused.reason)
        return self._finish(HTMLResponse(html, refused.status), None, False)

    def _done(self, session: Session, notice: str) -> Response:
        session.notice = notice
        return self._finish(RedirectResponse("/", 303), None, False)

    async def _act(
        self, request: Request, action: Callable[[Session, dict[str, list[str]]], Awaitable[str]]
    ) -> Response:
        try:
            session, fields = await self._form(request, signed_in=True)
            notice = await action(session, fields)
        except Refused as refused:
            return self._refused(refused)
        except (OutboxError, PyMongoError) as problem:
            return self._refused(Refused(503, one_line(problem)))
        log.info("console: %s", notice)
        return self._done(session, notice)

    async def login(self, request: Request) -> Response:
        try:
            session, fields = await self._form(request, signed_in=False)
        except Refused as refused:
            return self._refused(refused)
        if not self.credentials.configured:
            return self._refused(
                Refused(403, "the console is read-only: no credentials are configured")
            )
        answer = {k: (fields.get(k) or [""])[0] for k in ("token", "user", "password")}
        if not self.credentials.accept(answer["token"], answer["user"], answer["password"]):
            return self._refused(Refused(401, "wrong credentials"))
        # A new id on signing in: an id someone planted before is worth nothing now.
        self.sessions.end(session)
        signed = self.sessions.new(signed_in=True)
        signed.notice = "signed in"
        return self._finish(RedirectResponse("/", 303), signed, True)

    async def logout(self, request: Request) -> Response:
        try:
            session, _ = await self._form(request, signed_in=False)
        except Refused as refused:
            return self._refused(refused)
        self.sessions.end(session)
        response = RedirectResponse("/", 303)
        response.delete_cookie(COOKIE, path="/")
        return self._finish(response, None, False)

    async def requeue_parked(self, request: Request) -> Response:
        async def action(session: Session, fields: dict[str, list[str]]) -> str:
            ids = [i for i in fields.get("event_id", []) if i]
            if not ids:
                raise Refused(400, "choose the parked events to requeue")
            requeued = await data.requeue_parked(self.conn, ids)
            earlier = requeued - len(ids)
            also = (
                f", and {earlier} earlier parked events of their aggregates" if earlier > 0 else ""
            )
            if earlier < 0:
                return f"requeued {requeued} of {len(ids)} events: the rest are no longer parked"
            return f"requeued {len(ids)} parked events{also}"

        return await self._act(request, action)

    async def requeue_failed(self, request: Request) -> Response:
        async def action(session: Session, fields: dict[str, list[str]]) -> str:
            consumer = (fields.get("consumer") or [""])[0]
            if not consumer:
                raise Refused(400, "name the consumer")
            ids = [i for i in fields.get("message_id", []) if i]
            everything = (fields.get("all") or [""])[0] == "1"
            if not ids and not everything:
                raise Refused(400, "choose the failed messages to requeue")
            count = await data.requeue_failed(
                self.conn, self.settings.places, consumer, None if everything else ids
            )
            return (
                f"requeued {count} failed messages of {consumer}: their next delivery runs the "
                "handler again"
            )

        return await self._act(request, action)


def _age(seconds: float | None) -> str:
    return age(None if seconds is None else timedelta(seconds=seconds))


def _when(at: Any) -> str:
    if not isinstance(at, datetime):
        return "-" if at is None else str(at)
    return as_utc(at).strftime("%Y-%m-%d %H:%M:%S UTC")
