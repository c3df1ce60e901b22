"""Who may act on the console: the credentials from the environment, the browser sessions and
their CSRF tokens.

Reading is open to whoever reaches the page unless ``--require-sign-in`` (the default beyond
loopback); requeueing needs a signed-in session. The credentials come only from the environment,
never from an option, so they do not show in ``ps``: a token (``MONGO_OUTBOX_CONSOLE_TOKEN``), or
a user and a password (``MONGO_OUTBOX_CONSOLE_USER`` and ``MONGO_OUTBOX_CONSOLE_PASSWORD``). With
neither, nobody can sign in: there is no default that lets anyone act.

Every visitor gets a random id in an ``HttpOnly``, ``SameSite=Strict`` cookie and a CSRF token of
its own, which every form carries in a hidden field and every POST must return: another site
can make a browser send the cookie, but cannot read the token. Only signed-in sessions are kept
in memory; a visitor who is not signed in keeps nothing on the server (its token is an HMAC of
its id under a key the console draws at start), so requests without a cookie, however many,
cannot push a signed-in session out. Signing in gives a new id, so an id planted before cannot
be signed in by its victim. A restart signs everyone out.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

TOKEN = "MONGO_OUTBOX_CONSOLE_TOKEN"
USER = "MONGO_OUTBOX_CONSOLE_USER"
PASSWORD = "MONGO_OUTBOX_CONSOLE_PASSWORD"

COOKIE = "mongo_outbox_console"
SESSION_LIFETIME = 8 * 3600.0
"""Seconds a session lasts from its creation, signed in or not."""
MAX_SESSIONS = 10_000
"""Signed-in sessions kept at most, the oldest pushed out first. Only a sign-in makes one, and
sign-ins are limited (``limits.py``): this bound is never reached by guessing."""
MIN_SECRET = 12
"""The shortest token or password accepted, not counting whitespace: a shorter one is a guess
away."""
MAX_ID = 64
"""The longest cookie value read as a visitor's id; a longer one gets a new id."""


class CredentialsError(ValueError):
    """The environment's credentials are incomplete or too weak; the message says which."""


@dataclass(frozen=True)
class Credentials:
    """What signs an operator in: a token, or a user and a password (or both ways)."""

    token: str | None = None
    user: str | None = None
    password: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Credentials:
        token = environ.get(TOKEN) or None
        user = environ.get(USER) or None
        password = environ.get(PASSWORD) or None
        if (user is None) != (password is None):
            raise CredentialsError(f"set both {USER} and {PASSWORD}, or neither")
        if user is not None and not user.strip():
            raise CredentialsError(f"{USER} is blank")
        for name, secret in ((TOKEN, token), (PASSWORD, password)):
            # Twelve spaces are twelve characters, and no secret.
            if secret is not None and len(secret.strip()) < MIN_SECRET:
                raise CredentialsError(
                    f"{name} must be at least {MIN_SECRET} characters long, not counting whitespace"
                )
        return cls(token, user, password)

    @property
    def configured(self) -> bool:
        return self.token is not None or self.password is not None

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple(s for s in (self.token, self.password) if s)

    def accept(self, token: str, user: str, password: str) -> bool:
        """Whether a sign-in with these answers passes. Every comparison is made, in constant
        time, whichever way is configured: the time taken tells nothing."""
        good = False
        if self.token is not None:
            good |= _same(token, self.token)
        if self.user is not None and self.password is not None:
            good |= _same(user, self.user) & _same(password, self.password)
        return good


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


@dataclass
class Session:
    """A visitor's session: signed in and kept by ``Sessions``, or a visitor's, kept nowhere."""

    id: str
    csrf: str
    signed_in: bool = False
    created: float = field(default_factory=time.monotonic)
    notice: str | None = None
    """What the last action did, shown once on the next page (signed-in sessions only)."""

    def check(self, token: str | None) -> bool:
        return token is not None and _same(token, self.csrf)


class Sessions:
    """The signed-in sessions, by id, oldest first, and the visitors' CSRF tokens."""

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._key = secrets.token_bytes(32)

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, session_id: str | None) -> Session | None:
        """The signed-in session of this id, if it lives."""
        session = self._by_id.get(session_id or "")
        if session is None:
            return None
        if time.monotonic() - session.created > SESSION_LIFETIME:
            del self._by_id[session.id]
            return None
        return session

    def of(self, cookie: str | None) -> tuple[Session, bool]:
        """The session of a request's cookie, and whether it is new (its cookie to be set): the
        signed-in session, else the visitor's of that id, else a visitor's of a new id. Nothing
        is stored for a visitor."""
        found = self.get(cookie)
        if found is not None:
            return found, False
        fresh = not cookie or len(cookie) > MAX_ID
        visitor = secrets.token_urlsafe(32) if fresh or cookie is None else cookie
        return Session(visitor, self._visitor_csrf(visitor)), fresh

    def _visitor_csrf(self, visitor: str) -> str:
        mac = hmac.new(self._key, b"visitor:" + visitor.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def sign_in(self) -> Session:
        """A new signed-in session, under a new id."""
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), signed_in=True)
        self._by_id[session.id] = session
        while len(self._by_id) > MAX_SESSIONS:
            self._by_id.popitem(last=False)
        return session

    def end(self, session: Session) -> None:
        self._by_id.pop(session.id, None)
