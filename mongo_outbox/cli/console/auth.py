"""Who may act on the console: the credentials from the environment, the browser sessions and
their CSRF tokens.

Reading is open to whoever reaches the page (it listens on 127.0.0.1 unless told otherwise);
requeueing needs a signed-in session. The credentials come only from the environment, never
from an option, so they do not show in ``ps``: a token (``MONGO_OUTBOX_CONSOLE_TOKEN``), or a
user and a password (``MONGO_OUTBOX_CONSOLE_USER`` and ``MONGO_OUTBOX_CONSOLE_PASSWORD``). With
neither, nobody can sign in: there is no default that lets anyone act.

Every visitor gets a session (a random id in an ``HttpOnly``, ``SameSite=Strict`` cookie) with a
CSRF token of its own, which every form carries in a hidden field and every POST must return:
another site can make a browser send the cookie, but cannot read the token. Signing in replaces
the session id, so an id planted before cannot be signed in by its victim. Sessions live in the
console's memory: a restart signs everyone out.
"""

from __future__ import annotations

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
"""Sessions kept at most: a client that drops its cookie on every request cannot fill the
memory, it only pushes out the oldest sessions."""
MIN_SECRET = 12
"""The shortest token or password accepted: a shorter one is a guess away."""


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
        for name, secret in ((TOKEN, token), (PASSWORD, password)):
            if secret is not None and len(secret) < MIN_SECRET:
                raise CredentialsError(f"{name} must be at least {MIN_SECRET} characters long")
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
    id: str
    csrf: str
    signed_in: bool = False
    created: float = field(default_factory=time.monotonic)
    notice: str | None = None
    """What the last action did, shown once on the next page."""

    def check(self, token: str | None) -> bool:
        return token is not None and _same(token, self.csrf)


class Sessions:
    """The browser sessions, by id, oldest first."""

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def get(self, session_id: str | None) -> Session | None:
        session = self._by_id.get(session_id or "")
        if session is None:
            return None
        if time.monotonic() - session.created > SESSION_LIFETIME:
            del self._by_id[session.id]
            return None
        return session

    def new(self, signed_in: bool = False) -> Session:
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), signed_in)
        self._by_id[session.id] = session
        while len(self._by_id) > MAX_SESSIONS:
            self._by_id.popitem(last=False)
        return session

    def end(self, session: Session) -> None:
        self._by_id.pop(session.id, None)
