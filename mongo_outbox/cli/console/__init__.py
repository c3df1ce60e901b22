"""``mongo-outbox console``: a small web page where an operator sees the outbox at a glance
(backlog and its age, relays and group partitions, parked events, inbox failures, a live chart)
and requeues parked events and failed inbox messages.

It needs the ``console`` extra (Starlette, Jinja2, uvicorn): ``pip install
'mongo-outbox[console]'``, checked before anything else, as ``--metrics-port`` checks its own.
The page is read-only unless credentials are set in the environment or a users file
(``auth.py``: named readers and operators; requeues are audited), it listens on
127.0.0.1 unless ``--host`` says otherwise, answers to its allowed host names only
(``hosts.py``), and beyond loopback shows nothing until one signs in. ``app.py`` is the web
application, ``data.py`` what it reads, through the same functions as ``status``, ``parked`` and
``inbox``; ``redaction.py`` keeps credentials off what it shows, ``limits.py`` limits sign-in
guesses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from mongo_outbox.cli.common import (
    Connection,
    Failure,
    Target,
    connected,
    option,
    run,
    say,
    target_options,
    url_host,
)
from mongo_outbox.cli.console.auth import TOKEN, USER, Credentials, CredentialsError
from mongo_outbox.cli.relay import _databases
from mongo_outbox.errors import ConfigurationError
from mongo_outbox.settings import check_count, check_seconds

log = logging.getLogger("mongo_outbox.cli")

if TYPE_CHECKING:
    from mongo_outbox.cli.console.app import Settings

EXTRA = "the console needs pip install 'mongo-outbox[console]'"


def check_extra() -> None:
    """Fail in one line when the ``console`` extra is missing."""
    try:
        import jinja2  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise Failure(f"{EXTRA} (missing: {error.name})") from None


@click.command()
@target_options
@option("--host", default="127.0.0.1", show_default=True, help="The address to listen on.")
@option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8600,
    show_default=True,
    help="The port to listen on (0: any free one).",
)
@option(
    "--databases",
    help="Show the outbox of each of these databases (comma-separated; tenants), instead of "
    "--db's.",
)
@option(
    "--allowed-host",
    help="Another host name the console answers to (comma-separated; the loopback names and "
    "--host are allowed): the name a reverse proxy that keeps the original Host passes on.",
)
@option(
    "--require-sign-in/--no-require-sign-in",
    default=None,
    help="Show nothing until one signs in [default: on when --host is beyond loopback].",
)
@option(
    "--users-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Named users who can sign in, one a line, name:role:hash (role reader or operator; "
    "hash from python -m mongo_outbox.cli.console.newuser NAME ROLE).",
)
@option(
    "--runbook-url",
    help="Where the page's links to the runbooks go: the URL of docs/operating.md's page "
    "[default: the docs site's, else docs/operating.md relative to the page].",
)
@option(
    "--secure-cookies",
    is_flag=True,
    help="Mark the session cookie Secure, for a console reached over HTTPS only (behind a "
    "proxy that terminates TLS).",
)
@option(
    "--trusted-proxies",
    help="Addresses of the proxies whose X-Forwarded-For and X-Forwarded-Proto are believed "
    "(comma-separated; none by default).",
)
@option("--checkpoints", default="outbox_relays", show_default=True, help="Relays' checkpoints.")
@option("--inbox-collection", default="inbox", show_default=True, help="The inbox collection.")
@option(
    "--sample-interval",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds between two samples of the chart (and its page's polls).",
)
@option(
    "--history",
    type=float,
    default=15.0,
    show_default=True,
    help="Minutes of samples the chart shows.",
)
def console(
    target: Target,
    host: str,
    port: int,
    databases: str | None,
    allowed_host: str | None,
    require_sign_in: bool | None,
    users_file: Path | None,
    runbook_url: str | None,
    secure_cookies: bool,
    trusted_proxies: str | None,
    checkpoints: str,
    inbox_collection: str,
    sample_interval: float,
    history: float,
) -> None:
    """Serve a web console: backlog, relays and partitions, parked events, inbox failures and
    a live chart; requeue from it once signed in.

    Signing in needs MONGO_OUTBOX_CONSOLE_TOKEN, or MONGO_OUTBOX_CONSOLE_USER and
    MONGO_OUTBOX_CONSOLE_PASSWORD, in the environment (never on the command line), or named
    users of --users-file (readers and operators); without them the console is read-only.
    Beyond loopback, or behind a proxy (--allowed-host, --trusted-proxies), reading needs a
    sign-in too (--no-require-sign-in for an open page behind a proxy that authenticates).
    """
    check_extra()
    from mongo_outbox.cli.console.app import RUNBOOK_URL, Settings
    from mongo_outbox.cli.console.data import Places

    names = _databases(target, databases)
    if names:  # connected() checks the first; the others are on the same server
        target = dataclasses.replace(target, db=names[0])

    from mongo_outbox.cli.console.hosts import allowed_hosts, is_loopback

    if require_sign_in is None:
        # A proxy in front (a name it answers to, or proxies it believes) serves the page beyond
        # this machine as surely as a public address does: loopback alone is no closed door.
        require_sign_in = not is_loopback(host) or bool(allowed_host) or bool(trusted_proxies)
    try:
        credentials = Credentials.from_env(os.environ, users_file)
        extra_hosts = _listed(allowed_host)
        allowed_hosts(host, extra_hosts)  # a name that is none fails here, in one line
        if require_sign_in and not credentials.configured:
            raise CredentialsError(
                "reading needs a sign-in (--require-sign-in, the default beyond loopback or "
                f"behind a proxy), and nobody can sign in: set {TOKEN}, or {USER} and its "
                "password, or pass --users-file or --no-require-sign-in"
            )
        every = check_seconds(sample_interval, "--sample-interval")
        # Minutes, not check_seconds's seconds: its message would say "s".
        if not (math.isfinite(history) and history > 0):
            raise ConfigurationError(
                f"--history must be > 0 minutes, not {history!r}", setting="--history"
            )
        keep = check_count(max(1, round(history * 60 / every)), "--history")
    except (CredentialsError, ValueError) as error:
        raise Failure(str(error)) from None
    settings = Settings(
        target=target,
        places=Places(checkpoints, inbox_collection),
        credentials=credentials,
        host=host,
        allowed_hosts=extra_hosts,
        require_sign_in=require_sign_in,
        secure_cookies=secure_cookies,
        trusted_proxies=_listed(trusted_proxies),
        sample_every=every,
        samples_kept=keep,
        runbook_url=runbook_url or RUNBOOK_URL,
    )
    run(_serve(settings, port, names))


def _listed(option: str | None) -> tuple[str, ...]:
    return tuple(item.strip() for item in (option or "").split(",") if item.strip())


async def _serve(settings: Settings, port: int, databases: tuple[str, ...]) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn raises a SIGTERM or SIGINT again once it shut down, for the program
            # around it; here it is the whole program, and a clean stop exits 0, as the
            # relay's does.
            stops = (signal.SIGINT, signal.SIGTERM)
            before = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

    from mongo_outbox.cli.console.app import create_app
    from mongo_outbox.cli.console.hosts import is_loopback

    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    try:
        listening = socket.create_server((settings.host, port), family=family)
    except OSError as error:
        raise Failure(f"cannot listen on {settings.host}:{port}: {error.strerror}") from None
    bound = listening.getsockname()[1]
    with listening:
        async with connected(settings.target) as conn:
            conns = [conn]
            if databases:
                conns = [
                    Connection(conn.client, db, settings.target.outbox(db))
                    for db in (conn.client[name] for name in databases)
                ]
            app = create_app(conns, settings)
            # The app believes the proxies it was told to (--trusted-proxies), and no other:
            # uvicorn's own default would believe any process of this machine.
            config = uvicorn.Config(
                app, log_config=None, access_log=False, lifespan="on", proxy_headers=False
            )
            server = Server(config)
            mode = (
                f" (read-only: set {TOKEN}, or {USER} and its password, or --users-file, "
                "to requeue)"
            )
            if settings.credentials.configured:
                mode = ""
            say(f"console at http://{url_host(settings.host)}:{bound}/{mode}")
            if not is_loopback(settings.host):
                log.warning(
                    "console: listening on %s, beyond this machine, in plain HTTP: put a proxy "
                    "that terminates TLS in front of it (docs/console.md)",
                    settings.host,
                )
            await server.serve(sockets=[listening])
