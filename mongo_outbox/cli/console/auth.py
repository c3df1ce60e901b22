"""Who may act on the console: the credentials, the users they sign in as and their roles, the
browser sessions and their CSRF tokens.

Reading is open to whoever reaches the page unless ``--require-sign-in`` (the default beyond
loopback); requeueing needs a signed-in session of an operator. The secrets never come from an
option, so they do not show in ``ps``: a token (``MONGO_OUTBOX_CONSOLE_TOKEN``, signing in as
the operator ``token``), a user and a password (``MONGO_OUTBOX_CONSOLE_USER`` and
``MONGO_OUTBOX_CONSOLE_PASSWORD``, an operator), and named users from a file (``--users-file``),
one a line, ``name:role:hash``, each a reader or an operator, its secret kept only as a scrypt
hash (``hash_secret``). With none of them, nobody can sign in: there is no default that lets
anyone act.

A named user's secret is checked against its hash only, in constant time; a name nobody has
costs the same scrypt as a known one, so the time taken does not tell which names exist.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

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
MAX_CONFIRMATIONS = 16
"""Confirm pages a session keeps open at most (one per tab, say), the oldest dropped first."""


TOKEN_USER = "token"
"""The name the shared token signs in as: an operator, named in the audit lines like any other."""
SCRYPT = {"n": 2**14, "r": 8, "p": 1}
"""scrypt's cost for new hashes (16 MiB, tens of milliseconds): sign-ins are few and limited
(``limits.py``), a stolen file's guesses are costly."""
_MAX_MEMORY = 2**28
"""The most memory (bytes, 128 * n * r) one check of a users file's hash may take: a costlier
hash would make every sign-in, and every guess, take seconds and gigabytes."""


class CredentialsError(ValueError):
    """The credentials are incomplete or too weak, or the users file is malformed; the message
    says which (and, for the file, its line)."""


class Role(Enum):
    """What a signed-in user may do: read the page, or read and requeue."""

    READER = "reader"
    OPERATOR = "operator"


@dataclass(frozen=True)
class User:
    """Someone who can sign in: the name the audit lines give, and the role."""

    name: str
    role: Role

    @property
    def may_act(self) -> bool:
        return self.role is Role.OPERATOR


@dataclass(frozen=True)
class Hashed:
    """A secret's scrypt hash, as a users file stores it: ``scrypt$n$r$p$salt$hash`` (salt and
    hash in unpadded URL-safe base64)."""

    n: int
    r: int
    p: int
    salt: bytes
    digest: bytes

    @classmethod
    def parse(cls, text: str) -> Hashed:
        parts = text.split("$")
        if len(parts) != 6 or parts[0] != "scrypt":
            raise ValueError("the hash must read scrypt$n$r$p$salt$hash (hash_secret makes one)")
        try:
            n, r, p = (int(part) for part in parts[1:4])
            salt, digest = (_unb64(part) for part in parts[4:])
        except ValueError:
            raise ValueError("the hash's numbers or base64 do not parse") from None
        power_of_two = n > 1 and n & (n - 1) == 0
        if not (power_of_two and r > 0 and 128 * n * r <= _MAX_MEMORY and 0 < p <= 16):
            raise ValueError(
                "the hash's cost is out of bounds (n a power of 2, 128 * n * r at most "
                f"{_MAX_MEMORY >> 20} MiB, p at most 16)"
            )
        if len(salt) < 16 or len(digest) < 32:
            raise ValueError("the hash's salt or digest is too short")
        return cls(n, r, p, salt, digest)

    def __str__(self) -> str:
        return f"scrypt${self.n}${self.r}${self.p}${_b64(self.salt)}${_b64(self.digest)}"

    def matches(self, secret: str) -> bool:
        return hmac.compare_digest(self._derive(secret), self.digest)

    def _derive(self, secret: str) -> bytes:
        return hashlib.scrypt(
            secret.encode(),
            salt=self.salt,
            n=self.n,
            r=self.r,
            p=self.p,
            maxmem=_MAX_MEMORY + 2**20,
            dklen=len(self.digest),
        )


def hash_secret(secret: str) -> str:
    """The line part a users file keeps of ``secret``: its scrypt hash under a new salt."""
    _check_secret("the secret", secret)
    salt = secrets.token_bytes(16)
    digest = Hashed(SCRYPT["n"], SCRYPT["r"], SCRYPT["p"], salt, b"\0" * 32)._derive(secret)
    return str(Hashed(SCRYPT["n"], SCRYPT["r"], SCRYPT["p"], salt, digest))


# Checked for a name nobody has, so that an unknown name takes as long as a known one.
_NOBODY = Hashed(SCRYPT["n"], SCRYPT["r"], SCRYPT["p"], b"\0" * 16, b"\0" * 32)


def read_users(
    lines: Iterable[str], where: str = "the users file"
) -> dict[str, tuple[User, Hashed]]:
    """The users of a users file's lines, by name: ``name:role:hash`` a line, ``#`` comments and
    blank lines skipped; ``CredentialsError`` naming the line for any other."""
    users: dict[str, tuple[User, Hashed]] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(":")
        role_text, _, hash_text = rest.partition(":")
        name = name.strip()
        try:
            if not name or not hash_text:
                raise ValueError("a line reads name:role:hash")
            if name in users:
                raise ValueError(f"{name!r} is named twice")
            try:
                role = Role(role_text.strip())
            except ValueError:
                roles = " or ".join(r.value for r in Role)
                raise ValueError(f"the role must be {roles}, not {role_text.strip()!r}") from None
            users[name] = (User(name, role), Hashed.parse(hash_text.strip()))
        except ValueError as error:
            raise CredentialsError(f"{where}, line {number}: {error}") from None
    return users


def _check_secret(name: str, secret: str) -> None:
    # Twelve spaces are twelve characters, and no secret.
    if len(secret.strip()) < MIN_SECRET:
        raise CredentialsError(
            f"{name} must be at least {MIN_SECRET} characters long, not counting whitespace"
        )


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Credentials:
    """What signs someone in: a token, a user and a password (both operators), and the named
    users of a users file (``users``, by name), readers or operators; any of them together."""

    token: str | None = None
    user: str | None = None
    password: str | None = None
    users: Mapping[str, tuple[User, Hashed]] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], users_file: Path | None = None) -> Credentials:
        token = environ.get(TOKEN) or None
        user = environ.get(USER) or None
        password = environ.get(PASSWORD) or None
        if (user is None) != (password is None):
            raise CredentialsError(f"set both {USER} and {PASSWORD}, or neither")
        if user is not None and not user.strip():
            raise CredentialsError(f"{USER} is blank")
        for name, secret in ((TOKEN, token), (PASSWORD, password)):
            if secret is not None:
                _check_secret(name, secret)
        users: dict[str, tuple[User, Hashed]] = {}
        if users_file is not None:
            try:
                text = users_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise CredentialsError(f"cannot read {users_file}: {error}") from None
            users = read_users(text.splitlines(), f"users file {users_file}")
            for taken in (user, TOKEN_USER if token else None):
                if taken is not None and taken in users:
                    raise CredentialsError(
                        f"users file {users_file}: {taken!r} signs in from the environment already"
                    )
        return cls(token, user, password, users)

    @property
    def configured(self) -> bool:
        return self.token is not None or self.password is not None or bool(self.users)

    @property
    def named_login(self) -> bool:
        """Whether the sign-in form asks for a name and a password."""
        return self.password is not None or bool(self.users)

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple(s for s in (self.token, self.password) if s)

    def accept(self, token: str, user: str, password: str) -> User | None:
        """Who signs in with these answers, if anyone. Every comparison of the environment's
        secrets is made, in constant time, and a name from the users file costs one scrypt
        whether it exists or not: the time taken tells nothing of which part was wrong."""
        found: User | None = None
        if self.token is not None and _same(token, self.token):
            found = User(TOKEN_USER, Role.OPERATOR)
        pair = (self.user, self.password)
        if (
            pair[0] is not None
            and pair[1] is not None
            and _same(user, pair[0]) & _same(password, pair[1])
        ):
            found = User(pair[0], Role.OPERATOR)
        if self.users:
            known, hashed = self.users.get(user, (None, _NOBODY))
            if hashed.matches(password) and known is not None:
                found = known
        return found


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


@dataclass
class Session:
    """A visitor's session: signed in and kept by ``Sessions``, or a visitor's, kept nowhere."""

    id: str
    csrf: str
    user: User | None = None
    """Who signed in; ``None`` for a visitor."""
    created: float = field(default_factory=time.monotonic)
    notice: str | None = None
    """What the last action did, shown once on the next page (signed-in sessions only)."""
    confirmations: OrderedDict[str, str] = field(default_factory=OrderedDict)
    """The confirm pages' tokens this session was shown and has not used, each with the action
    it confirms; the latest ``MAX_CONFIRMATIONS``."""

    @property
    def signed_in(self) -> bool:
        return self.user is not None

    def check(self, token: str | None) -> bool:
        return token is not None and _same(token, self.csrf)

    def confirmation(self, what: str) -> str:
        """A new token that confirms ``what`` (an action, its exact fields and the question its
        page asks) for this session, once: only that action of that session matches it, so a
        forged or replayed "requeue all" cannot skip the confirmation."""
        token = secrets.token_urlsafe(32)
        self.confirmations[token] = what
        while len(self.confirmations) > MAX_CONFIRMATIONS:
            self.confirmations.popitem(last=False)
        return token

    def confirmed(self, token: str, what: str) -> bool:
        """Whether ``token`` is one this session was shown for ``what``, used up if so: a form
        posted twice (a double click, the browser's back and resend, a replay) confirms once,
        and the second post asks again, with what it would do then."""
        if self.confirmations.get(token) != what:
            return False
        del self.confirmations[token]
        return True


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

    def sign_in(self, user: User) -> Session:
        """A new session of ``user``, under a new id."""
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), user)
        self._by_id[session.id] = session
        while len(self._by_id) > MAX_SESSIONS:
            self._by_id.popitem(last=False)
        return session

    def end(self, session: Session) -> None:
        self._by_id.pop(session.id, None)
