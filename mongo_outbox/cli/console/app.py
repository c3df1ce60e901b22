"""The console's web application: a Starlette app that renders one page on the server, JSON
endpoints the page's script polls, and the two actions (requeue parked events, requeue failed
inbox messages), each a plain HTML form.

It serves one outbox, or one per database (``--databases``, tenants): the page lists each
one's backlog, and shows the details (chart, relays, parked events, inbox) of the one chosen
with ``?db=``.

Every request's ``Host`` must be an allowed name (``hosts.py``). Every POST passes three checks,
in this order: the session's CSRF token (``auth.py``), then a signed-in session of an operator
(a reader is refused, 403), then the action's own fields; a sign-in takes its place among the
limited guesses (``limits.py``) before its answer is checked. A requeue of everything (every
parked event the filters keep, every failed message of a consumer) first answers a confirm page,
whose form carries a token of that action and session; every requeue done is written to the
``mongo_outbox.cli.console.audit`` log, naming who, what and how many. With ``require_sign_in``,
nothing is read for a visitor who is not signed in. Without configured credentials nobody can
sign in, and the page says the console is read-only. Responses forbid framing (a hidden frame
could make an operator click "requeue") and allow scripts and styles from the console only. The
data a page or a JSON answer shows is redacted before it is rendered (``redaction.py``): no
credential is ever shown; and every text a page renders has its bidirectional controls made
visible (``bidi.py``). Each problem shown links to its runbook section (``RUNBOOKS``).

A page tells what it could not read: when MongoDB does not answer, the page says so on top and
shows no number in place of those it could not read; each part read when the page was made
carries its time, and its script marks it stale once the live numbers moved on.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlencode

import jinja2
import markupsafe
from pymongo.errors import PyMongoError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from mongo_outbox.cli.common import Connection, Target, age, hide, one_line
from mongo_outbox.cli.console import data
from mongo_outbox.cli.console.auth import (
    COOKIE,
    SESSION_LIFETIME,
    Credentials,
    Session,
    Sessions,
)
from mongo_outbox.cli.console.bidi import visible
from mongo_outbox.cli.console.hosts import HostCheck, allowed_hosts
from mongo_outbox.cli.console.limits import OVERALL, PER_CLIENT, Rate, SignInLimit, retry_after
from mongo_outbox.cli.console.redaction import redacted
from mongo_outbox.errors import OutboxError
from mongo_outbox.events import as_utc, utc_now

log = logging.getLogger("mongo_outbox.cli")
audit = logging.getLogger("mongo_outbox.cli.console.audit")
"""One line per requeue (and per refused one): who, from where, what, how many."""
T = TypeVar("T")

HERE = Path(__file__).parent
MAX_FORM = 64 * 1024
"""Bytes a form may have: a requeue of every shown event fits many times over."""
READ_TIMEOUT = 10.0
"""Seconds the reads of one page or one JSON answer may take: a MongoDB that stopped answering
(a connection hung without a reset) shows as an outage, not as a page that never comes. A
MongoDB that refuses connections fails sooner, at the client's server selection timeout (3 s)."""
READ_ONLY = "the console is read-only: no credentials are configured"
SITE_URL: str | None = None
"""The documentation site, mkdocs.yml's ``site_url`` (a test keeps the two the same)."""
RUNBOOK_URL = f"{SITE_URL}operating/" if SITE_URL else "docs/operating.md"
"""Where the runbooks are by default (``--runbook-url``): their page on the documentation site,
else docs/operating.md relative to the page (for a proxy that serves the docs beside it)."""
RUNBOOKS = {
    "parked": ("runbook-parked-events", "Runbook: parked events"),
    "inbox": ("inbox-dead-letters", "Inbox dead letters"),
    "no-owner": ("what-a-crash-costs", "What a crash costs"),
    "outage": ("what-a-crash-costs", "What a crash costs"),
}
"""Each problem the page shows, and the heading of docs/operating.md (its anchor, its title)
that says what to do about it."""
FAVICON = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
    b'<rect width="16" height="16" rx="3" fill="#13aa52"/>'
    b'<path d="M4 8h8M9 5l3 3-3 3" stroke="#fff" stroke-width="2" fill="none"/></svg>'
)
"""The console's icon, an arrow leaving a box: served, so that a browser's request for it is
no 404, and drawn here, so that there is nothing to build."""
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
    it believes, the sign-in guesses it checks, the chart's sampling, and where its links to
    the runbooks go (the page of docs/operating.md, without an anchor)."""

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
    runbook_url: str = RUNBOOK_URL


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
            # Every {{ value }} a template shows, whatever it is: none can be forgotten.
            finalize=_finalize,
        )
        self.templates.filters["age"] = _age
        self.templates.filters["when"] = _when
        self.templates.filters["verbatim"] = Verbatim
        self.templates.globals["runbook"] = self._runbook
        self.app = Starlette(
            routes=[
                Route("/", self.page),
                Route("/favicon.ico", self.favicon),
                Route("/event", self.event_page),
                Route("/search", self.search),
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

    def _runbook(self, problem: str) -> dict[str, str]:
        anchor, title = RUNBOOKS[problem]
        return {"href": f"{self.settings.runbook_url}#{anchor}", "title": title}

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
        # The page's script shows some of it (an error, what the relays' signature is built
        # of): its bidirectional controls are made visible here, as the page's are.
        text = json.dumps(_visible_all(self._shown(plain)), ensure_ascii=False)
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

    def _common(self, session: Session) -> dict[str, Any]:
        """What every page of a session needs: its CSRF token, who it is and what it may do,
        and the sign-in form's fields."""
        return {
            "csrf": session.csrf,
            "configured": self.credentials.configured,
            "token_login": self.credentials.token is not None,
            "password_login": self.credentials.named_login,
            "signed_in": session.signed_in,
            "user": session.user.name if session.user else None,
            "may_act": session.user is not None and session.user.may_act,
        }

    async def favicon(self, request: Request) -> Response:
        # Browsers ask for it on every load: an answer, not a 404 in every log.
        response = Response(FAVICON, media_type="image/svg+xml")
        response = self._finish(request, response, None, False)
        response.headers["Cache-Control"] = "public, max-age=86400"
        return response

    async def page(self, request: Request) -> Response:
        session, fresh = self._session(request)
        common = self._common(session)
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
        places = self.settings.places
        read_at = utc_now()

        async def read() -> dict[str, Any]:
            outboxes = []
            if len(self.conns) > 1:  # each one's backlog, on top of the chosen one's details
                outboxes = [await data.backlog(c) for c in self.conns.values()]
            overview = await self._overview(conn)
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
            sample_every=self.settings.sample_every,
        )
        response = HTMLResponse(html, 503 if error else 200)
        return self._finish(request, response, session, fresh)

    async def _detail(self, request: Request, status: int, **context: Any) -> Response:
        """The event page: one event (``event``), an aggregate's events (``events``), or
        why there is none (``missing``)."""
        session, fresh = self._session(request)
        context = {
            "event": None,
            "events": None,
            "aggregate": None,
            "missing": None,
            "error": None,
            **context,
        }
        html = self._render("event.html", **self._common(session), **context)
        return self._finish(request, HTMLResponse(html, status), session, fresh)

    async def _reader(self, request: Request) -> tuple[Connection | None, Response | None]:
        """The chosen database's connection for a visitor who may read, else the answer."""
        session, fresh = self._session(request)
        if not session.signed_in and self.settings.require_sign_in:
            html = self._render("sign-in.html", **self._common(session))
            return None, self._finish(request, HTMLResponse(html, 401), session, fresh)
        try:
            return self._conn(request.query_params.get("db")), None
        except Refused as refused:
            return None, self._refused(request, refused)

    async def event_page(self, request: Request) -> Response:
        """One event's detail, read whole: ``/event?id=``."""
        conn, answer = await self._reader(request)
        if conn is None:
            assert answer is not None
            return answer
        event_id = request.query_params.get("id", "")
        db = conn.db.name
        if not event_id:
            return await self._detail(request, 400, db=db, missing="name an event id: ?id=")
        try:
            found = await self._read(data.event(conn, event_id))
        except Unread as problem:
            return await self._detail(request, 503, db=db, error=self._shown(str(problem)))
        if found is None:
            # The id as the request sent it, escaped, not redacted (see ``page``).
            missing = (
                f"this outbox holds no event of id {event_id} (never saved, or published "
                "and no longer kept)"
            )
            return await self._detail(request, 404, db=db, missing=missing)
        return await self._detail(request, 200, db=db, event=self._shown(found))

    async def search(self, request: Request) -> Response:
        """``/search?q=``: an exact event id opens its detail; else the events not yet
        published of the aggregate of that id."""
        conn, answer = await self._reader(request)
        if conn is None:
            assert answer is not None
            return answer
        asked = request.query_params.get("q", "").strip()
        db = conn.db.name
        if not asked:
            return await self._detail(
                request, 400, db=db, missing="type an event id or an aggregate id"
            )

        async def read() -> tuple[bool, list[dict[str, Any]]]:
            if await data.admin(conn).event(asked) is not None:
                return True, []
            return False, await data.of_aggregate(conn, asked)

        try:
            is_event, events = await self._read(read())
        except Unread as problem:
            return await self._detail(request, 503, db=db, error=self._shown(str(problem)))
        if is_event:
            where = "/event?" + urlencode({"db": db, "id": asked})
            return self._finish(request, RedirectResponse(where, 303), None, False)
        if not events:
            missing = f"no event of id {asked}, and no pending or parked event of aggregate {asked}"
            return await self._detail(request, 404, db=db, missing=missing, aggregate=asked)
        return await self._detail(request, 200, db=db, aggregate=asked, events=self._shown(events))

    async def _overview(self, conn: Connection) -> dict[str, Any]:
        """``data.overview``, with every relay's rates over the chart's samples."""
        report = await data.overview(conn, self.settings.target, self.settings.places)
        sampler = self.samplers[conn.db.name]
        report["activity"] = data.activity_rows(report, sampler.rates())
        return report

    async def overview_json(self, request: Request) -> Response:
        if not self._may_read(request):
            return self._json(request, {"error": SIGN_IN_TO_READ}, 401)
        try:
            conn = self._conn(request.query_params.get("db"))
            report = await self._read(self._overview(conn))
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
        """The POST's session and fields, once its CSRF token (and, if asked, the sign-in of an
        operator) passed: else ``Refused``."""
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
        if signed_in and session.user is None:
            raise Refused(401, "sign in to act")
        if signed_in and session.user is not None and not session.user.may_act:
            audit.warning(
                "%s (%s) from %s refused %s: a reader may not requeue",
                _quoted(session.user.name),
                session.user.role.value,
                _client(request),
                request.url.path,
            )
            raise Refused(403, f"{session.user.name} may only read: requeueing needs an operator")
        return session, fields

    def _refused(
        self, request: Request, refused: Refused, headers: dict[str, str] | None = None
    ) -> Response:
        reason = self._shown(refused.reason)
        log.warning(
            "console: refused %s %s from %s: %s",
            request.method,
            request.url.path,
            _client(request),
            visible(reason),
        )
        html = self._render("refused.html", reason=reason)
        response = HTMLResponse(html, refused.status, headers=headers)
        return self._finish(request, response, None, False)

    def _back(self, request: Request, fields: dict[str, list[str]]) -> Response:
        db = _field(fields, "db")
        where = "/?" + urlencode({"db": db}) if db else "/"
        return self._finish(request, RedirectResponse(where, 303), None, False)

    @staticmethod
    def _confirms(request: Request, fields: Fields, plan: Plan) -> str:
        """What a confirmation of this action confirms: its exact fields, and the question its
        page asked (with its count: once more are parked, the operator is asked again)."""
        kept = sorted((k, v) for k, vs in fields.items() if k not in _UNCONFIRMED for v in vs)
        return f"{request.url.path}?{urlencode(kept)}\0{plan.asks}"

    async def _act(self, request: Request, action: Action) -> Response:
        """Run ``action`` for a signed-in operator: a requeue of everything answers a confirm
        page first, unless the form is that page's (its confirmation token matches); what it
        did is the next page's notice and an audit line."""
        plan: Plan | None = None
        try:
            session, fields = await self._form(request, signed_in=True)
            conn = self._conn(_field(fields, "db"))
            plan = await action.plan(conn, fields)
            what = self._confirms(request, fields, plan)
            if plan.asks is not None and not session.confirmed(_field(fields, "confirm"), what):
                confirmation = session.confirmation(what)
                return self._confirm(request, session, fields, plan, confirmation)
            done = await action.run(conn, fields, plan)
        except Refused as refused:
            return self._refused(request, refused)
        except (OutboxError, PyMongoError) as problem:
            assert session.user is not None  # _form let it through signed in
            audit.warning(
                "%s (%s) from %s: requeue of %s in %s failed: %s",
                _quoted(session.user.name),
                session.user.role.value,
                _client(request),
                plan.what if plan else action.kind,
                _quoted(conn.db.name),
                _quoted(one_line(problem)),
            )
            return self._refused(request, Refused(503, one_line(problem)))
        assert session.user is not None
        audit.info(
            "%s (%s) from %s requeued %d %s in %s: %s",
            _quoted(session.user.name),
            session.user.role.value,
            _client(request),
            done.count,
            action.kind,
            _quoted(conn.db.name),
            plan.what,
        )
        session.notice = done.notice
        return self._back(request, fields)

    def _confirm(
        self, request: Request, session: Session, fields: Fields, plan: Plan, confirmation: str
    ) -> Response:
        # The fields go back as they came (the hidden inputs keep them verbatim), with the
        # token that says this very action was confirmed on this page.
        carried = [(k, v) for k, vs in fields.items() if k not in _UNCONFIRMED for v in vs]
        db = _field(fields, "db")
        html = self._render(
            "confirm.html",
            **self._common(session),
            asks=self._shown(plan.asks),
            action=request.url.path,
            carried=carried,
            confirmation=confirmation,
            back="/?" + urlencode({"db": db}) if db else "/",
        )
        return self._finish(request, HTMLResponse(html), None, False)

    async def login(self, request: Request) -> Response:
        try:
            session, fields = await self._form(request, signed_in=False)
            if not self.credentials.configured:
                raise Refused(403, READ_ONLY)
            # The guess takes its place before its answer is checked: guesses sent at once are
            # refused unchecked once the places are taken.
            wait = self.guesses.take(_client(request, ""))
            if wait:
                refused = Refused(429, "too many sign-in attempts: try again later")
                return self._refused(request, refused, {"Retry-After": retry_after(wait)})
            answers = (_field(fields, "token"), _field(fields, "user"), _field(fields, "password"))
            # In a thread: a users file's scrypt takes tens of milliseconds, which the other
            # requests (the page's polls) need not wait for; the limit above bounds how many
            # run at once.
            user = await asyncio.to_thread(self.credentials.accept, *answers)
            if user is None:
                raise Refused(401, "wrong credentials")
        except Refused as refused:
            return self._refused(request, refused)
        # A new id on signing in: an id someone planted before is worth nothing now.
        self.sessions.end(session)
        signed = self.sessions.sign_in(user)
        reads = "" if user.may_act else " (reading only)"
        signed.notice = f"signed in as {user.name}{reads}"
        log.info(
            "console: %s (%s) signed in from %s",
            _quoted(user.name),
            user.role.value,
            _client(request),
        )
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
        return await self._act(request, RequeueParked())

    async def requeue_failed(self, request: Request) -> Response:
        return await self._act(request, RequeueFailed(self.settings.places))


Fields = dict[str, list[str]]
_UNCONFIRMED = frozenset({"csrf", "confirm"})
"""The fields a confirmation does not cover: the session's token, and the confirmation's own."""


@dataclass(frozen=True)
class Plan:
    """What a requeue is about to do: what it chose, as the audit line says it (its texts
    quoted, so that no value can forge a line), and, for a requeue of everything, the question
    its confirm page asks (else ``None``)."""

    what: str
    asks: str | None = None
    ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Done:
    """What a requeue did: the notice shown, and how many came back."""

    notice: str
    count: int


class Action(abc.ABC):
    """A requeue of the console: planned (checked, and asked to be confirmed if it takes
    everything), then run."""

    kind: str

    @abc.abstractmethod
    async def plan(self, conn: Connection, fields: Fields) -> Plan: ...

    @abc.abstractmethod
    async def run(self, conn: Connection, fields: Fields, plan: Plan) -> Done: ...


class RequeueParked(Action):
    """Chosen parked events, or every one the page's filters keep (``matching``), as
    ``parked requeue`` (``--type --aggregate``, or ``--all`` with no filter) does."""

    kind = "parked events"

    async def plan(self, conn: Connection, fields: Fields) -> Plan:
        if _field(fields, "matching") == "1":
            types = [t for t in fields.get("type", []) if t]
            aggregates = [a for a in fields.get("aggregate", []) if a]
            filters = [
                f"{name} in {_quoted(values)}"
                for name, values in (("type", types), ("aggregate", aggregates))
                if values
            ]
            what = "every parked event" + (" with " + " and ".join(filters) if filters else "")
            shown = [
                f"{name} {' or '.join(values)}"
                for name, values in (("of type", types), ("of aggregate", aggregates))
                if values
            ]
            count = len(await data.matching(conn, types, aggregates))
            asks = f"Requeue all {count} parked events" + (f" {', '.join(shown)}" if shown else "")
            return Plan(what, f"{asks} in {conn.db.name}?")
        ids = tuple(i for i in fields.get("event_id", []) if i)
        if not ids:
            raise Refused(400, "choose the parked events to requeue")
        return Plan(f"event ids {_quoted(list(ids))}", ids=ids)

    async def run(self, conn: Connection, fields: Fields, plan: Plan) -> Done:
        ids: Sequence[str] = plan.ids
        if plan.asks is not None:
            # Read again once confirmed: what matches now, not what matched on the confirm page.
            types = [t for t in fields.get("type", []) if t]
            aggregates = [a for a in fields.get("aggregate", []) if a]
            ids = await data.matching(conn, types, aggregates)
            if not ids:
                return Done("no parked event matches: nothing was requeued", 0)
        requeued = await data.requeue_parked(conn, list(ids))
        earlier = requeued - len(ids)
        if earlier < 0:
            notice = f"requeued {requeued} of {len(ids)} events: the rest are no longer parked"
            return Done(notice, requeued)
        also = f", and {earlier} earlier parked events of their aggregates" if earlier else ""
        return Done(f"requeued {len(ids)} parked events{also}", requeued)


class RequeueFailed(Action):
    """Chosen failed messages of a consumer, or all of them (``all``), as ``inbox requeue``."""

    kind = "failed messages"

    def __init__(self, places: data.Places) -> None:
        self.places = places

    async def plan(self, conn: Connection, fields: Fields) -> Plan:
        consumer = _field(fields, "consumer")
        if not consumer:
            raise Refused(400, "name the consumer")
        ids = tuple(i for i in fields.get("message_id", []) if i)
        of = f"of consumer {_quoted(consumer)}"
        if _field(fields, "all") == "1":
            asks = f"Requeue every failed message of {consumer} in {conn.db.name}?"
            return Plan(f"every failed message {of}", asks)
        if not ids:
            raise Refused(400, "choose the failed messages to requeue")
        return Plan(f"message ids {_quoted(list(ids))} {of}", ids=ids)

    async def run(self, conn: Connection, fields: Fields, plan: Plan) -> Done:
        consumer = _field(fields, "consumer")
        chosen = None if plan.asks is not None else list(plan.ids)
        count = await data.requeue_failed(conn, self.places, consumer, chosen)
        notice = (
            f"requeued {count} failed messages of {consumer}: their next delivery runs the "
            "handler again"
        )
        return Done(notice, count)


def _quoted(value: Any) -> str:
    """``value`` as an audit or log line writes it: JSON, every control and non-ASCII
    character escaped, so that no name or id can end the line or reorder it."""
    return json.dumps(value)


def _client(request: Request, unknown: str = "?") -> str:
    return request.client.host if request.client else unknown


class Verbatim(str):
    """A value a template sends back as it is (a hidden field's, an option's value): not
    made visible, so that the form carries the stored text."""


def _finalize(value: Any) -> Any:
    if isinstance(value, str) and not isinstance(value, (Verbatim, markupsafe.Markup)):
        return visible(value)
    return value


def _visible_all(value: Any) -> Any:
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, dict):
        return {key: _visible_all(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_visible_all(item) for item in value]
    return value


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
