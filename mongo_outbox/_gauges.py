"""The gauges' side of ``metrics``: values that running relays cache in memory, and the
observable gauges whose callbacks read them (from the exporter's thread), so that a scrape never
waits for MongoDB."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, get_args

from mongo_outbox.events import as_utc, utc_now
from mongo_outbox.stats import RelayStatus, State

log = logging.getLogger("mongo_outbox.metrics")

STATES: tuple[State, ...] = get_args(State)
FIRST_READ_TIMEOUT = 2.0
"""Seconds a starting relay waits for its first backlog read (an outage must not hold it)."""


def relay_labels(name: str, database: str, partition: int | None = None) -> dict[str, str]:
    """A relay's attributes: its name, its outbox's database (one process may relay several
    databases under one relay name: ``tenants``) and, for a relay group's member, the
    partition it publishes."""
    labels = {"relay": name, "database": database}
    if partition is not None:
        labels["partition"] = str(partition)
    return labels


@dataclass(frozen=True)
class _Backlog:
    pending: int
    oldest_at: datetime | None  # when the oldest pending event occurred
    parked: int
    checkpoint_at: datetime | None


class RelayGauges:
    """One relay object's gauge values: its state as it changes, and its backlog as its last
    ``status()`` read it. A relay is reported from its first ``run()`` on (a relay object
    that only monitors is not), its backlog only while ``run()`` runs."""

    def __init__(self, name: str, database: str, partition: int | None = None) -> None:
        self.name = name
        self.labels = relay_labels(name, database, partition)
        self.state: State = "starting"
        self.backlog: _Backlog | None = None

    def update(self, status: RelayStatus) -> None:
        age = status.oldest_pending_age
        at = status.last_checkpoint_at
        # A whole snapshot at once: callbacks read it from the exporter's thread.
        self.backlog = _Backlog(
            pending=status.pending,
            oldest_at=utc_now() - age if age is not None else None,
            parked=status.parked,
            checkpoint_at=as_utc(at) if at is not None else None,
        )

    @contextlib.asynccontextmanager
    async def refreshing(self, status: Callable[[], Awaitable[RelayStatus]]) -> AsyncIterator[None]:
        """While the block runs, refresh the backlog from ``status()`` every ``REFRESH_EVERY``
        seconds once a gauge was observed. The block starts after a first read (within
        ``FIRST_READ_TIMEOUT``), so that the first scrape of a relay that just started already
        has its backlog: an alert on a gauge's absence would fire at every restart otherwise.
        Without a metrics SDK nothing is read."""
        # metrics owns the instruments (and REFRESH_EVERY, which tests tune): the gauges exist
        # from now on, also if nothing is ever published.
        from mongo_outbox import metrics

        instruments = metrics._instruments()
        if instruments is not None and _collected(instruments.gauges[0]):
            await self._first_read(status)
        with _lock:
            _relays.add(self)
        task = asyncio.ensure_future(self._refresh(status))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.backlog = None

    async def _first_read(self, status: Callable[[], Awaitable[RelayStatus]]) -> None:
        try:
            self.update(await asyncio.wait_for(status(), FIRST_READ_TIMEOUT))
        except Exception as error:  # noqa: BLE001 - an outage: the relay itself reports it
            log.debug("relay %s: gauges not read at start: %s", self.name, error)

    async def _refresh(self, status: Callable[[], Awaitable[RelayStatus]]) -> None:
        from mongo_outbox import metrics

        # Read at start already (_first_read): the next read is due REFRESH_EVERY later.
        refreshed = time.monotonic() if self.backlog is not None else float("-inf")
        while True:
            now = time.monotonic()
            every = metrics.REFRESH_EVERY
            if _observed and now - refreshed >= every:
                refreshed = now
                try:
                    self.update(await status())
                except Exception as error:  # noqa: BLE001 - the relay itself reports outages
                    log.debug("relay %s: gauges not refreshed: %s", self.name, error)
            await asyncio.sleep(min(1.0, every))


_relays: weakref.WeakSet[RelayGauges] = weakref.WeakSet()
_lock = threading.Lock()  # relays are added in the event loop, read in the exporter's thread
_observed = False  # a gauge was collected: someone reads them, so relays refresh them


def _collected(gauge: Any) -> bool:
    """Whether a metrics SDK stands behind ``gauge``: the API's own instruments (its no-op, or
    a proxy for which no provider was set yet) never call back."""
    while gauge is not None and type(gauge).__module__.startswith("opentelemetry.metrics"):
        gauge = getattr(gauge, "_real_instrument", None)
    return gauge is not None


def unobserved() -> None:
    """Forget that a gauge was collected: relays stop refreshing until one is again."""
    global _observed
    _observed = False


def _callback(
    values: Callable[[], Iterator[tuple[float, dict[str, str]]]],
) -> Callable[[Any], Iterator[Any]]:
    def observe(options: Any) -> Iterator[Any]:
        from opentelemetry.metrics import Observation

        global _observed
        _observed = True
        for value, attributes in values():
            yield Observation(value, attributes)

    return observe


def _running() -> list[RelayGauges]:
    with _lock:
        return list(_relays)


def _backlogs() -> Iterator[tuple[dict[str, str], _Backlog]]:
    for gauges in _running():
        backlog = gauges.backlog
        if backlog is not None:
            yield gauges.labels, backlog


def _pending() -> Iterator[tuple[float, dict[str, str]]]:
    for labels, backlog in _backlogs():
        yield backlog.pending, labels


def _oldest() -> Iterator[tuple[float, dict[str, str]]]:
    now = utc_now()
    for labels, backlog in _backlogs():
        age = _seconds(now - backlog.oldest_at) if backlog.oldest_at and backlog.pending else 0.0
        yield age, labels


def _parked() -> Iterator[tuple[float, dict[str, str]]]:
    for labels, backlog in _backlogs():
        yield backlog.parked, labels


def _lag() -> Iterator[tuple[float, dict[str, str]]]:
    now = utc_now()
    for labels, backlog in _backlogs():
        if backlog.checkpoint_at is not None:
            yield _seconds(now - backlog.checkpoint_at), labels


def _counts() -> Iterator[tuple[dict[str, str], dict[State, int]]]:
    # Relay objects of one name and database in one process (a leader and a standby, say) add up.
    counts: dict[tuple[str, ...], tuple[dict[str, str], dict[State, int]]] = {}
    for gauges in _running():
        key = tuple(gauges.labels.values())
        _, per_state = counts.setdefault(key, (gauges.labels, dict.fromkeys(STATES, 0)))
        per_state[gauges.state] += 1
    return iter(counts.values())


def _active() -> Iterator[tuple[float, dict[str, str]]]:
    for labels, per_state in _counts():
        yield per_state["active"], labels


def _states() -> Iterator[tuple[float, dict[str, str]]]:
    for labels, per_state in _counts():
        for state, count in per_state.items():
            yield count, labels | {"state": state}


def _seconds(delta: timedelta) -> float:
    return max(delta.total_seconds(), 0.0)


def observe(meter: Any) -> list[Any]:
    """The observable gauges, on ``meter``."""
    gauges: list[tuple[str, str, str, Callable[[], Iterator[tuple[float, dict[str, str]]]]]] = [
        ("mongo_outbox_pending_events", "", "Pending outbox events", _pending),
        ("mongo_outbox_oldest_pending_age", "s", "Age of the oldest pending event", _oldest),
        ("mongo_outbox_parked_events", "", "Parked (dead-lettered) outbox events", _parked),
        ("mongo_outbox_checkpoint_lag", "s", "Time since the last checkpoint", _lag),
        ("mongo_outbox_relay_active", "", "Relays that publish now (leader)", _active),
        ("mongo_outbox_relay_state", "", "Relays in each state", _states),
    ]
    return [
        meter.create_observable_gauge(
            name, callbacks=[_callback(values)], unit=unit, description=text
        )
        for name, unit, text, values in gauges
    ]
