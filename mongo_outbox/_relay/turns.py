"""Turns: the relays of several tenants in one process take turns at their rounds.

Side by side, each tenant's relay starts its next round as soon as its last one ends, so a
tenant with a backlog keeps MongoDB (its claims and settles) and a shared publisher (its waves)
busy without a pause, and a tenant that has one event waits behind all of it: measured, the
others' commit-to-broker p50 went from 0.6 s to 10-21 s while one tenant drained 5,000 events.

With turns, one claim or settle (a round's MongoDB work) runs at a time, and when it ends the
next turn goes to the next tenant, in a fixed rotation, that has one waiting: a tenant waits
for at most one claim or settle of each other tenant, whatever their backlogs. Unless another
waiting tenant used less of the turns' time (by a tenth of ``budget``): then that one goes
first, so a trickle's short turns do not each wait for a backlog's long one. Publishing takes
no turn: it waits for the broker, and one tenant's hanging publish must not hold up the others.
And while several tenants are active, each round is smaller (``share``: an in-flight budget),
so that what another tenant waits for is short. A tenant alone takes full rounds, turn after
turn, without waiting.

A round's size is bounded by time as well as by count (``sized``): while other tenants relay
here, a tenant's first round takes one entry, and its rounds double while their turns stay well
within ``budget`` and halve once one outlasts it (``IDLE_SCALE`` times the budget while the
others are idle: their next event waits for one such turn, and the backlog drains faster). A
turn is what another tenant's claim waits for, and MongoDB's work for it delays their other
commands too. Measured through ``mongo-outbox relay --databases`` (benchmarks/bench_tenants.py,
change streams, embedded mode, on the emulator): counting alone left the trickling tenants a
p50 of 2-9 s and a max of 6-16 s beside a backlog, its first full round's claim and settle
holding the turn for 8 s; with the time bound and the time-fair rotation, p50 0.4 s, max 0.7 s.
Most of those seconds are the emulator's: it serves one command at a time, and a settle of 100
documents takes it 6 s (a trickling tenant's claim of one change, not taking turns, waited 8 s
inside it); a replica set serves commands side by side, in milliseconds, so there a full round
fits the budget and the bound never bites.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

RECENT = 2.0
"""Seconds after its last claim of something a tenant still counts as active (a trickling one
comes back)."""
BUDGET = 0.25
"""Seconds one turn (a claim or a settle) may hold the others up: what sizes a round by time."""
IDLE_SCALE = 4
"""How many times ``budget`` a turn may last while no other tenant is active."""
FIXED_ROUNDS = 16
"""How many of a tenant's latest rounds its shortest turn is taken from (see ``sized``)."""


class Turns:
    """A fair lock over tenants: ``turn(tenant)`` holds it for one claim or settle."""

    def __init__(self, budget: float = BUDGET, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        """Seconds a turn may last while other tenants relay here (see ``sized``)."""
        self._clock = clock
        self._order: list[str] = []  # the rotation, in order of first appearance
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._holder: str | None = None
        self._last: str | None = None
        self._seen: dict[str, float] = {}  # each tenant's last turn, monotonic
        self._granted_at = 0.0  # when the turn under way was granted, monotonic
        self._longest: dict[str, float] = {}  # each tenant's longest turn since its last round
        self._size: dict[str, int] = {}  # each tenant's round size that fits the budget
        self._recent: dict[str, deque[float]] = {}  # each tenant's latest rounds' turns, s
        self._scale: dict[str, int] = {}  # the budget's scale of each tenant's last share
        self._used: dict[str, float] = {}  # each tenant's turns' time, seconds (see _release)
        self.history: deque[str] = deque(maxlen=1000)
        """The tenants of the latest turns, in order (for tests and diagnostics)."""

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        self.join(tenant)
        if tenant != self._holder and not self._waits(tenant):
            # Back from idle: no credit for the time it did not use (it would then hold the
            # turn for as long, while the others wait).
            busy = [self._used[t] for t in self._order if t == self._holder or self._waits(t)]
            self._used[tenant] = max(self._used.get(tenant, 0.0), min(busy, default=0.0))
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

    def share(self, tenant: str, limit: int, *, timed: bool = True) -> int:
        """How many entries ``tenant``'s next round may claim (its in-flight budget): ``limit``
        while no other tenant claimed anything lately, else ``limit / n**2`` with ``n`` tenants
        active (a tenant waiting for a turn now is active); and, ``timed``, bounded by the size
        that keeps its turns within ``budget`` (``sized``) while it is not alone here. A
        round's claim and settle keep MongoDB busy for the others' change streams and claims
        too, not only for its turn, so a backlog's rounds must be short while others have
        events to send: measured (benchmarks/bench_tenants.py), with three tenants an equal
        share (``limit / n``) left the trickling ones a p50 of 2 s, ``limit / n**2`` 0.5 s."""
        now = self._clock()
        others = sum(
            1
            for t in self._order
            if t != tenant and (now - self._seen.get(t, -math.inf) < RECENT or self._waits(t))
        )
        share = max(1, limit // (others + 1) ** 2)
        if timed and len(self._order) > 1:
            # An idle tenant's next event waits for this round's turns too. A first round
            # takes one entry, and full rounds double until their turns outgrow the budget:
            # a full one may take seconds. While the others are idle, IDLE_SCALE times
            # longer turns are allowed: the backlog drains faster, and one event waits for
            # at most one of them.
            scale = 1 if others else IDLE_SCALE
            self._scale[tenant] = scale
            share = min(share, self._size.get(tenant, 1) * scale)
        return share

    def join(self, tenant: str) -> None:
        """Put ``tenant`` in the rotation before its first turn, so that the others' first
        rounds are sized knowing it is there."""
        if tenant not in self._waiting:
            self._order.append(tenant)
            self._waiting[tenant] = deque()

    def sized(self, tenant: str, asked: int, full: bool) -> None:
        """``tenant``'s round of ``asked`` (its claim's limit) ended; ``full``: it found as many
        as it asked. If its longest turn held on past ``budget`` (``IDLE_SCALE`` times that if
        the round was sized while the others were idle; or twice its shortest of the latest
        rounds, on a server slower than that for any command), its next round's size is
        halved; if well under it, and the round was full, doubled (a round that found little
        says nothing of a full one's cost)."""
        held = self._longest.pop(tenant, 0.0)
        # The shortest of its latest rounds' turns: what any command costs it on this server.
        recent = self._recent.setdefault(tenant, deque(maxlen=FIXED_ROUNDS))
        recent.append(held)
        fixed = min(recent)
        scale = self._scale.get(tenant, 1)
        target = max(self.budget * scale, 2 * fixed)
        if held > target:
            self._size[tenant] = max(1, asked // scale // 2)
        elif full and held < max(target / 2, 1.5 * fixed):
            # Well within the budget, or little more than any command costs on a server
            # slower than the budget: a larger round costs the others little more.
            self._size[tenant] = max(1, asked // scale) * 2

    def _waits(self, tenant: str) -> bool:
        return any(not granted.done() for granted in self._waiting.get(tenant, ()))

    def worked(self, tenant: str) -> None:
        """``tenant``'s claim found something to send: it counts as active for ``RECENT`` s.
        (An idle tenant's empty polls do not: they must not shrink a backlog's rounds.)"""
        self._seen[tenant] = self._clock()

    def _grant(self, tenant: str) -> None:
        self._holder = self._last = tenant
        self._granted_at = self._clock()
        self.history.append(tenant)

    def _release(self) -> None:
        if self._holder is not None:
            held = self._clock() - self._granted_at
            self._longest[self._holder] = max(self._longest.get(self._holder, 0.0), held)
            self._used[self._holder] = self._used.get(self._holder, 0.0) + held
        self._holder = None
        start = self._order.index(self._last) + 1 if self._last in self._order else 0
        rotation = self._order[start:] + self._order[:start]
        waiting = [t for t in rotation if self._waits(t)]
        if not waiting:
            for queue in self._waiting.values():
                queue.clear()  # only cancelled ones are left
            return
        # The next in rotation, unless another used a quantum less of the turns' time: a
        # tenant of short turns (a trickle's claim of one change) is not made to wait for a
        # long one's (a backlog's settle) as often as it takes turns.
        tenant = waiting[0]
        least = min(waiting, key=lambda t: self._used.get(t, 0.0))
        if self._used.get(least, 0.0) < self._used.get(tenant, 0.0) - self.budget / 10:
            tenant = least
        queue = self._waiting[tenant]
        while queue:
            granted = queue.popleft()
            if not granted.done():
                self._grant(tenant)
                granted.set_result(None)
                return
