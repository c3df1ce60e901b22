"""Turns: the relays of several tenants in one process take turns at their rounds.

Side by side, each tenant's relay starts its next round as soon as its last one ends, so a
tenant with a backlog keeps MongoDB (its claims and settles) and a shared publisher (its waves)
busy without a pause, and a tenant that has one event waits behind all of it: measured, the
others' commit-to-broker p50 went from 0.6 s to 10-21 s while one tenant drained 5,000 events.

With turns, one claim or settle (a round's MongoDB work) runs at a time, and when it ends the
next turn goes to the next tenant, in a fixed rotation, that has one waiting: a tenant waits
for at most one claim or settle of each other tenant, whatever their backlogs. Publishing takes
no turn: it waits for the broker, and one tenant's hanging publish must not hold up the others.
And while several tenants are active, each round is smaller (``share``: an in-flight budget),
so that what another tenant waits for is short. A tenant alone, or the only one with work,
takes full rounds, turn after turn, without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

RECENT = 2.0
"""Seconds after its last claim of something a tenant still counts as active (a trickling one
comes back)."""


class Turns:
    """A fair lock over tenants: ``turn(tenant)`` holds it for one claim or settle."""

    def __init__(self) -> None:
        self._order: list[str] = []  # the rotation, in order of first appearance
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._holder: str | None = None
        self._last: str | None = None
        self._seen: dict[str, float] = {}  # each tenant's last turn, monotonic
        self.history: deque[str] = deque(maxlen=1000)
        """The tenants of the latest turns, in order (for tests and diagnostics)."""

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        if tenant not in self._waiting:
            self._order.append(tenant)
            self._waiting[tenant] = deque()
        if self._holder is not None or any(self._waiting.values()):
            granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting[tenant].append(granted)
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():
                    self._release()  # granted as it was cancelled: pass the turn on
                else:
                    self._waiting[tenant].remove(granted)
                raise
        else:
            self._grant(tenant)
        try:
            yield
        finally:
            self._release()

    def share(self, tenant: str, limit: int) -> int:
        """How many entries ``tenant``'s next round may claim (its in-flight budget): ``limit``
        while no other tenant claimed anything lately, else ``limit / n**2`` with ``n`` tenants
        active. A round's claim and settle keep MongoDB busy for the others' change streams
        and claims too, not only for its turn, so a backlog's rounds must be short while others
        have events to send: measured (benchmarks/bench_tenants.py), with three tenants an
        equal share (``limit / n``) left the trickling ones a p50 of 2 s, ``limit / n**2`` 0.5 s,
        while the backlog still drained at about 250 events a second on the emulator."""
        now = time.monotonic()
        others = sum(1 for t, at in self._seen.items() if t != tenant and now - at < RECENT)
        return max(1, limit // (others + 1) ** 2) if others else limit

    def worked(self, tenant: str) -> None:
        """``tenant``'s claim found something to send: it counts as active for ``RECENT`` s.
        (An idle tenant's empty polls do not: they must not shrink a backlog's rounds.)"""
        self._seen[tenant] = time.monotonic()

    def _grant(self, tenant: str) -> None:
        self._holder = self._last = tenant
        self.history.append(tenant)

    def _release(self) -> None:
        self._holder = None
        start = self._order.index(self._last) + 1 if self._last in self._order else 0
        for tenant in self._order[start:] + self._order[:start]:
            queue = self._waiting[tenant]
            while queue:
                granted = queue.popleft()
                if not granted.done():
                    self._grant(tenant)
                    granted.set_result(None)
                    return
