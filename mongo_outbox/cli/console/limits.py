"""How many sign-in guesses the console checks: a few per client, and a few more overall.

A guess takes its place before its answer is checked, and a guess that finds no place is
refused (429) unchecked: sent all at once, twenty guesses are no faster than twenty sent one
after another, and the right one among them is refused like the others once the places are
taken. A pause after each wrong answer would not do this: the answers would only come later.

Each limit is a token bucket: ``burst`` guesses at once, then one more every ``every``
seconds. A client is its address (as uvicorn saw it, or as a trusted proxy said), an IPv6
address counted with its /64 network, which one host usually holds whole. The overall limit
stops guessing from many addresses, at a price: while somebody guesses from many addresses, an
operator may have to wait too.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rate:
    """``burst`` guesses at once, then one every ``every`` seconds."""

    burst: int
    every: float


PER_CLIENT = Rate(burst=5, every=10.0)
"""Five guesses at once, then six a minute, from one address."""
OVERALL = Rate(burst=20, every=2.0)
"""Twenty guesses at once, then thirty a minute, from all addresses together."""


class _Bucket:
    def __init__(self, rate: Rate, now: float) -> None:
        self.rate = rate
        self.tokens = float(rate.burst)
        self.at = now

    def refill(self, now: float) -> None:
        self.tokens = min(self.rate.burst, self.tokens + (now - self.at) / self.rate.every)
        self.at = now

    def wait(self) -> float:
        """Seconds until a token is there (0 if one is)."""
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) * self.rate.every

    @property
    def full(self) -> bool:
        return self.tokens >= self.rate.burst


class SignInLimit:
    """The places for sign-in guesses, per client and overall.

    ``take`` is synchronous and awaits nothing, so two guesses never take one place: a guess's
    answer is checked (in a thread, for a users file's scrypt) only once its place is taken."""

    def __init__(
        self,
        per_client: Rate = PER_CLIENT,
        overall: Rate = OVERALL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_client = per_client
        self.clock = clock
        self.overall = _Bucket(overall, clock())
        self.clients: dict[str, _Bucket] = {}

    def take(self, client: str) -> float:
        """Take a place for a guess from ``client``: 0 if it may be checked, else the seconds
        until it could be (the guess is not checked, and takes nothing)."""
        now = self.clock()
        self._forget_full(now)
        key = client_key(client)
        mine = self.clients.get(key) or _Bucket(self.per_client, now)
        mine.refill(now)
        self.overall.refill(now)
        wait = max(mine.wait(), self.overall.wait())
        if wait:
            return max(wait, 1e-3)
        mine.tokens -= 1
        self.overall.tokens -= 1
        self.clients[key] = mine
        return 0.0

    def _forget_full(self, now: float) -> None:
        # A bucket that filled up again is the same as none: dropping it keeps the table as
        # small as the guesses of the last burst * every seconds, whoever sends them.
        for key, bucket in list(self.clients.items()):
            bucket.refill(now)
            if bucket.full:
                del self.clients[key]


def client_key(address: str) -> str:
    """The client an address counts as: itself, or its /64 network for IPv6."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(parsed)


def retry_after(wait: float) -> str:
    """A ``Retry-After`` header's value: whole seconds, at least 1."""
    return str(max(1, math.ceil(wait)))
