"""Which ``Host`` the console answers to, wherever it listens.

A page of another site whose name was made to resolve to the console's address (DNS rebinding)
is of that site's origin for the browser, and could read the console and post to it; its
requests carry that site's name in ``Host``, which gives it away. So every request's Host must
be one of the allowed names: the loopback names, the address the console listens on (unless it
listens on every address), and the names given with ``--allowed-host`` (the name a reverse proxy
passes on when it keeps the original Host, as Caddy and Traefik do by default).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from mongo_outbox.errors import ConfigurationError

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
EVERY_ADDRESS = frozenset({"", "0.0.0.0", "::"})


def name_of(host: str) -> str | None:
    """The host name of a ``Host`` header or an option (port, brackets and a final dot
    dropped, lower case), or None when it is not one."""
    try:
        name = urlsplit(f"//{host.strip()}").hostname
    except ValueError:  # an unbalanced bracket
        return None
    return name.rstrip(".") if name else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name to listen on) stays on this machine."""
    name = name_of(host) or host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_hosts(listening_on: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names the console answers to when it listens on ``listening_on``."""
    names = set(LOOPBACK)
    if listening_on not in EVERY_ADDRESS:
        names.add(name_of(listening_on) or listening_on)
    for host in extra:
        name = name_of(host)
        if name is None:
            raise ConfigurationError(
                f"--allowed-host {host!r} is not a host name", setting="--allowed-host"
            )
        names.add(name)
    return frozenset(names)


class HostCheck:
    """Refuses (400) a request whose ``Host`` is missing or not allowed."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # One Host, allowed: two would leave it to each reader which one counts.
            hosts = [value for key, value in scope["headers"] if key == b"host"]
            name = name_of(hosts[0].decode("latin-1")) if len(hosts) == 1 else None
            if name not in self.allowed:
                refused = PlainTextResponse(
                    "this console does not answer to this host name (--allowed-host adds one)",
                    400,
                )
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)
