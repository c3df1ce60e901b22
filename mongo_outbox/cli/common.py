"""What every command shares: the options that name the outbox (each with its ``MONGO_OUTBOX_*``
environment twin), a MongoDB connection checked within seconds, failures told in one line,
output as a table or JSON, and the rule that no credential is ever printed or logged.

Every URL a command is given has its credentials registered as secrets (``hide``); whatever the
command line prints or logs passes through ``scrub``, which replaces them, so a password cannot
leak through a driver's or broker client's error text either.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import click
from pymongo import AsyncMongoClient
from pymongo.errors import ConfigurationError as MongoConfigurationError
from pymongo.errors import PyMongoError

from mongo_outbox.errors import OutboxError, describe
from mongo_outbox.events import utc_now
from mongo_outbox.outbox import Outbox
from mongo_outbox.publishers import redact_url, url_secrets
from mongo_outbox.tenants import current_database

log = logging.getLogger("mongo_outbox.cli")

ENV = "MONGO_OUTBOX_"
CHECK_TIMEOUT_MS = 3000
"""How long the first contact with MongoDB may take before a command gives up on it."""
CLOSE_TIMEOUT_S = 2.0
"""How long a command that is done waits for its MongoDB connections to close."""

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class Failure(click.ClickException):
    """A command's failure, printed as one line (``mongo-outbox: <message>``), exit status 1."""


# -- secrets ----------------------------------------------------------------------------------

_SECRETS: set[str] = set()


def hide(url: str) -> str:
    """Register the credentials in ``url`` (a password, a NATS token, or a query parameter
    that holds one: ``redact_url``) as secrets, and return ``url`` as it may be shown."""
    # Very short secrets would garble every line they happen to occur in; the URL itself
    # is still shown redacted.
    _SECRETS.update(s for s in url_secrets(url) if len(s) >= 4)
    return redact_url(url)


def scrub(text: str) -> str:
    """``text`` with every registered secret replaced by ``***``."""
    for secret in sorted(_SECRETS, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


class _Scrubbed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record))


def _name_the_tenant(record: logging.LogRecord) -> bool:
    # relay --databases: every database's relay has the same name, so its lines say which.
    database = current_database()
    record.tenant = f"[{database}] " if database else ""
    return True


def configure_logging(level: str) -> None:
    """Log to stderr, one line per record, with secrets scrubbed. Only the command line does
    this: the library never configures handlers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_name_the_tenant)
    handler.setFormatter(_Scrubbed("%(asctime)s %(levelname)s %(name)s: %(tenant)s%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    chosen = logging.getLevelName(level.upper())
    # Other libraries' chatter stays at warnings unless debugging was asked for.
    root.setLevel(chosen if chosen <= logging.DEBUG else max(chosen, logging.WARNING))
    logging.getLogger("mongo_outbox").setLevel(chosen)


def url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def say(text: str = "") -> None:
    click.echo(scrub(text))


def one_line(error: BaseException) -> str:
    """An error as one short line: PyMongo's server-selection errors end in a whole topology
    description, which says nothing more."""
    text = describe(error) if isinstance(error, OutboxError) else str(error) or type(error).__name__
    text = text.splitlines()[0] if text.strip() else text
    for cut in (" (configured timeouts", ", Timeout:", ", full error:"):
        text = text.split(cut, 1)[0]
    return text[:400]


# -- options ----------------------------------------------------------------------------------


def env(flag: str) -> str:
    """The environment twin of ``--flag-name``: ``MONGO_OUTBOX_FLAG_NAME``."""
    return ENV + flag.lstrip("-").replace("-", "_").upper()


def option(flag: str, **settings: Any) -> Callable[[F], F]:
    """A click option with its environment twin, shown in ``--help``."""
    return click.option(flag, envvar=env(flag), show_envvar=True, **settings)


@dataclass(frozen=True)
class Target:
    """Where the outbox is: the options every command takes."""

    uri: str
    db: str | None
    mode: str
    collections: tuple[str, ...]
    outbox_collection: str

    def outbox(self, database: Any) -> Outbox:
        return Outbox(
            database,
            mode=self.mode,  # type: ignore[arg-type]
            collection=self.outbox_collection,
            collections=self.collections,
        )

    def describe(self, database: str) -> str:
        if self.mode == "embedded":
            return f"{database}: {', '.join(self.collections)} (embedded mode)"
        return f"{database}.{self.outbox_collection} (collection mode)"


def target_options(function: F) -> F:
    """Add the options that name the outbox (and the log level) to a command, which receives
    them as one ``target: Target``."""

    @functools.wraps(function)
    def command(
        uri: str,
        db: str | None,
        mode: str,
        collections: str | None,
        outbox_collection: str,
        log_level: str,
        **rest: Any,
    ) -> Any:
        configure_logging(log_level)
        hide(uri)
        names = tuple(name.strip() for name in (collections or "").split(",") if name.strip())
        if mode == "embedded" and not names:
            raise Failure(f"--mode embedded needs --collections ({env('--collections')})")
        target = Target(uri, db, mode, names, outbox_collection)
        return function(target=target, **rest)

    options = [
        option("--uri", required=True, help="MongoDB connection string."),
        option("--db", help="Database of the outbox [default: the URI's database]."),
        option(
            "--mode",
            type=click.Choice(["collection", "embedded"]),
            default="collection",
            show_default=True,
            help="Where the outbox keeps its events.",
        ),
        option("--collections", help="Aggregate collections, comma-separated (embedded mode)."),
        option(
            "--outbox-collection",
            default="outbox",
            show_default=True,
            help="The outbox collection (collection mode), or the prefix of its event-id "
            "registry (embedded mode).",
        ),
        option(
            "--log-level",
            type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
            default="info",
            show_default=True,
        ),
    ]
    for add in reversed(options):
        command = add(command)
    return command  # type: ignore[return-value]


def selection(ids: bool, filters: bool, everything: bool, choices: str) -> None:
    """Refuse a requeue that names nothing, or ``--all`` beside a narrower choice: a requeue
    of everything is never a default."""
    if everything and (ids or filters):
        raise Failure(f"--all stands alone: choose {choices}")
    if not (ids or filters or everything):
        raise Failure(f"choose what to requeue: {choices}")


# -- MongoDB ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Connection:
    client: Any
    db: Any
    outbox: Outbox


@contextlib.asynccontextmanager
async def connected(target: Target, *, service: bool = False) -> AsyncIterator[Connection]:
    """Connect to the target's MongoDB, failing within ``CHECK_TIMEOUT_MS`` with one line if it
    does not answer. A ``service`` (the relay) then reconnects with the driver's defaults, so a
    later outage is waited out rather than failed fast."""
    shown = hide(target.uri)
    try:
        client: Any = AsyncMongoClient(
            target.uri, tz_aware=True, serverSelectionTimeoutMS=CHECK_TIMEOUT_MS
        )
    except (PyMongoError, ValueError, OSError) as error:
        # PyMongo checks some options as it parses them: a TLS key file that cannot be read
        # is an OSError, not one of its own errors.
        raise Failure(f"bad MongoDB URI {shown}: {one_line(error)}") from None
    try:
        try:
            await client.admin.command("ping")
        except PyMongoError as error:
            raise Failure(f"MongoDB at {shown} is unreachable: {one_line(error)}") from None
        if service:
            await client.close()
            client = AsyncMongoClient(target.uri, tz_aware=True)
        try:
            database = client[target.db] if target.db else client.get_default_database()
        except MongoConfigurationError:
            raise Failure(
                f"name the database: --db ({env('--db')}), or put it in the URI"
            ) from None
        yield Connection(client, database, target.outbox(database))
    finally:
        # A MongoDB that stopped answering holds close() up until the driver's monitor gives
        # up on it (connectTimeoutMS, 20 s): the command is done, so it waits no longer.
        try:
            await asyncio.wait_for(client.close(), CLOSE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.debug("MongoDB did not answer the close within %gs", CLOSE_TIMEOUT_S)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; a library error or a database error becomes a one-line
    failure."""
    try:
        return asyncio.run(main)
    except (OutboxError, PyMongoError) as error:
        raise Failure(one_line(error)) from None


# -- output -----------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    return str(value)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, default=_plain, ensure_ascii=False)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> str:
    cells = [list(headers), *[["-" if v is None else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        indent
        + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )


def age(delta: timedelta | None) -> str:
    """A duration as an operator reads it: ``0.4s``, ``3m12s``, ``5h02m``, ``2d03h``."""
    if delta is None:
        return "-"
    total = delta.total_seconds()
    if total < 60:
        return f"{total:.1f}s"
    minutes, secs = divmod(int(total), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"


def ago(at: datetime | None, now: datetime | None = None) -> timedelta | None:
    if at is None:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return (now or utc_now()) - at


_SPAN = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def moment(text: str, flag: str) -> datetime:
    """A point in time: an ISO 8601 date or time (UTC unless it says otherwise), or a span
    back from now such as ``90s``, ``15m``, ``2h``, ``7d`` or ``1h30m``."""
    spans = _SPAN.findall(text.strip())
    if spans and "".join(n + u for n, u in spans) == text.strip():
        return utc_now() - timedelta(seconds=sum(float(n) * _UNITS[u] for n, u in spans))
    try:
        at = datetime.fromisoformat(re.sub(r"[Zz]$", "+00:00", text.strip()))
    except ValueError:
        raise Failure(
            f"{flag} {text!r} is neither an ISO 8601 time (2024-05-01T12:00:00Z) nor a span "
            "back from now (90s, 15m, 2h, 7d)"
        ) from None
    return at if at.tzinfo else at.replace(tzinfo=timezone.utc)
