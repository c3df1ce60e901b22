"""The relays' and the inbox's metrics, through the OpenTelemetry metrics API.

Without the ``otel`` extra (``opentelemetry-api``) every hook here returns at once, and
``import mongo_outbox`` never imports OpenTelemetry. With the API but no SDK, the hooks record
into OpenTelemetry's no-op instruments and no gauge is ever observed, so the relays never read
anything for them. The library configures no exporter: an application installs an SDK
``MeterProvider`` (or calls ``use()``), and ``mongo-outbox relay --metrics-port`` serves them to
Prometheus.

Counters and the handler histogram are recorded where things happen (one call per relay round,
per failed publish, per inbox delivery). Gauges are observable: their callbacks read values
cached in memory, which a running relay reads from its ``status()`` as it starts (when an SDK
collects: the first scrape has them) and then every ``REFRESH_EVERY`` seconds once any gauge
was observed, so a scrape never waits for MongoDB.
Ages are computed at observation time from cached moments (the oldest pending event's, the
last checkpoint's), so they keep growing when a relay is stuck. A guard's dead letters are
counted from its inbox the same way, in the guard's event loop (``InboxGauge``): a counter of
dead letters could not make an alert fire on a consumer's first one (its series appears at 1,
no increase) nor keep it firing while the message stays dead-lettered.

Prometheus names (the exporter adds ``_total`` to counters and ``_seconds`` for unit ``s``):

| name | kind | attributes |
|---|---|---|
| ``mongo_outbox_published_total`` | counter | ``relay``, ``database`` |
| ``mongo_outbox_publish_failures_total`` | counter | ``relay``, ``database``, ``reason`` |
| ``mongo_outbox_relay_recoveries_total`` | counter | ``relay``, ``database`` |
| ``mongo_outbox_pending_events`` | gauge | ``relay``, ``database`` |
| ``mongo_outbox_oldest_pending_age_seconds`` | gauge | ``relay``, ``database`` |
| ``mongo_outbox_parked_events`` | gauge | ``relay``, ``database`` |
| ``mongo_outbox_checkpoint_lag_seconds`` | gauge | ``relay``, ``database`` (change-stream relays) |
| ``mongo_outbox_relay_active`` | gauge | ``relay``, ``database`` |
| ``mongo_outbox_relay_state`` | gauge | ``relay``, ``database``, ``state`` |
| ``mongo_outbox_inbox_messages_total`` | counter | ``consumer``, ``outcome`` |
| ``mongo_outbox_handler_duration_seconds`` | histogram | ``consumer`` |
| ``mongo_outbox_inbox_dead_letters`` | gauge | ``consumer``, ``database`` |

``reason`` is one of ``FAILURE_REASONS``.

The handler histogram asks for buckets from 1 ms to 60 s; opentelemetry-api older than 1.30
cannot ask, and the SDK's default buckets (meant for milliseconds) apply unless a ``View`` sets
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, get_args

from mongo_outbox.errors import (
    BrokerFullError,
    ConfigurationError,
    InvalidEventError,
    unavailable,
)
from mongo_outbox.events import as_utc, utc_now
from mongo_outbox.status import RelayStatus, State

__all__ = ["FAILURE_REASONS", "METER_NAME", "REFRESH_EVERY", "use"]

log = logging.getLogger(__name__)

METER_NAME = "mongo_outbox"
"""The OpenTelemetry meter (instrumentation scope) every instrument belongs to."""
REFRESH_EVERY = 5.0
"""Seconds between two refreshes of a running relay's gauges from its ``status()``."""
FAILURE_REASONS = (
    "invalid_event",  # no broker can carry it: parked at once
    "broker_unavailable",  # the broker as a whole (also a confirmation that timed out)
    "broker_full",  # the destination is full: waits until it drains
    "no_destination",  # no stream or queue takes it: waits, parked if it stays its own
    "error",  # any other refusal: an attempt that counts towards max_attempts
)
"""The values of ``mongo_outbox_publish_failures_total``'s ``reason`` attribute."""
INBOX_OUTCOMES = ("handled", "duplicate", "retry", "dead_lettered")
"""The values of ``mongo_outbox_inbox_messages_total``'s ``outcome`` attribute."""
# Handler durations from a millisecond to the server's 60 s transaction lifetime.
HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STATES: tuple[State, ...] = get_args(State)
FIRST_READ_TIMEOUT = 2.0
"""Seconds a starting relay waits for its first backlog read (an outage must not hold it)."""


# -- the instruments --------------------------------------------------------------------------


class _Instruments:
    def __init__(self, meter: Any) -> None:
        self.published = meter.create_counter(
            "mongo_outbox_published", description="Events the broker confirmed"
        )
        self.failures = meter.create_counter(
            "mongo_outbox_publish_failures", description="Failed publishes, by reason"
        )
        self.recoveries = meter.create_counter(
            "mongo_outbox_relay_recoveries",
            description="Change-stream recoveries: the stream could not resume, sweep and watch",
        )
        self.inbox = meter.create_counter(
            "mongo_outbox_inbox_messages", description="Inbox deliveries, by outcome"
        )
        description = "How long a guarded handler ran (one attempt)"
        try:
            self.duration = meter.create_histogram(
                "mongo_outbox_handler_duration",
                unit="s",
                description=description,
                explicit_bucket_boundaries_advisory=HANDLER_BUCKETS,
            )
        except TypeError:  # opentelemetry-api < 1.30 takes no advisory (SDK default buckets)
            self.duration = meter.create_histogram(
                "mongo_outbox_handler_duration", unit="s", description=description
            )
        self.gauges = _observable_gauges(meter)
        self.zeroed: set[tuple[str, frozenset[tuple[str, str]]]] = set()


_UNBOUND: Any = object()
_bound: _Instruments | None = _UNBOUND


def use(meter_provider: Any = None) -> None:
    """Record into ``meter_provider`` (an OpenTelemetry ``MeterProvider``) from now on; ``None``
    goes back to the global one (``opentelemetry.metrics.set_meter_provider``), the default.
    Without the ``otel`` extra, ``None`` is accepted and nothing is recorded."""
    global _bound
    _bound = _bind(meter_provider) if meter_provider is not None else _global()
    _unobserved()  # until the new provider collects


def _bind(meter_provider: Any) -> _Instruments | None:
    try:
        from opentelemetry import metrics
    except ImportError:
        if meter_provider is not None:
            raise ConfigurationError(
                "metrics need OpenTelemetry: pip install 'mongo-outbox[otel]'",
                setting="metrics.use",
            ) from None
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("mongo-outbox")
    except PackageNotFoundError:  # run from a source tree
        ours = ""
    provider = meter_provider or metrics.get_meter_provider()
    return _Instruments(provider.get_meter(METER_NAME, ours))


@functools.lru_cache(maxsize=1)
def _global() -> _Instruments | None:
    # Once: the global provider keeps every instrument it was asked for.
    return _bind(None)


def _instruments() -> _Instruments | None:
    global _bound
    if _bound is _UNBOUND:
        # Bound on first use, not at import: importing the library costs nothing.
        _bound = _global()
    return _bound


# -- hooks: where things happen ---------------------------------------------------------------


def relay_started(relay: dict[str, str], *, recovers: bool = False) -> None:
    """A relay's counters exist from its start, at zero: Prometheus' ``increase()`` reads a
    series that first appears at 1 as no increase, so the first parked event of a process, or
    its first publish, would go unseen by an alert. ``recovers``: a change-stream relay's, whose
    recoveries are counted too."""
    instruments = _instruments()
    if instruments is not None:
        _at_zero(instruments, "published", relay)
        _at_zero(instruments, "failures", relay, "reason", FAILURE_REASONS)
        if recovers:
            _at_zero(instruments, "recoveries", relay)


def published(relay: dict[str, str] | None, count: int) -> None:
    """A round's confirmed events (one call per round, not per event). ``relay`` (its
    ``relay_labels``) is ``None`` for rounds that are not a relay's (a replay): those are not
    counted."""
    instruments = _instruments()
    if instruments is not None and relay is not None and count:
        instruments.published.add(count, relay)


def publish_failed(relay: dict[str, str] | None, error: BaseException) -> None:
    instruments = _instruments()
    if instruments is not None and relay is not None:
        instruments.failures.add(1, relay | {"reason": failure_reason(error)})


def failure_reason(error: BaseException) -> str:
    """Which of ``FAILURE_REASONS`` a failed publish counts under, as the relay classifies it
    (docs/failures.md)."""
    if isinstance(error, InvalidEventError):
        return "invalid_event"
    if not unavailable(error):
        return "error"
    if isinstance(error, BrokerFullError):
        return "broker_full"
    return "no_destination" if getattr(error, "destination", None) else "broker_unavailable"


def recovered(relay: dict[str, str]) -> None:
    instruments = _instruments()
    if instruments is not None:
        instruments.recoveries.add(1, relay)


def inbox_started(consumer: str) -> None:
    """A guarded consumer's outcomes exist at zero from its first message on (and from its
    guard's making, if metrics were set up by then), so that its first dead letter is an
    increase an alert sees (see ``relay_started``)."""
    instruments = _instruments()
    if instruments is not None:
        _at_zero(instruments, "inbox", {"consumer": consumer}, "outcome", INBOX_OUTCOMES)


def inbox_outcome(consumer: str, outcome: str) -> None:
    instruments = _instruments()
    if instruments is not None:
        _at_zero(instruments, "inbox", {"consumer": consumer}, "outcome", INBOX_OUTCOMES)
        instruments.inbox.add(1, {"consumer": consumer, "outcome": outcome})


def _at_zero(
    instruments: _Instruments,
    counter: str,
    labels: dict[str, str],
    key: str | None = None,
    values: tuple[str, ...] = (),
) -> None:
    """Add 0 to the ``counter``'s series of ``labels`` (one per ``key`` value), once an SDK
    records them: a zero added before an SDK was installed (a guard made at import, the
    exporter set up in ``main()``) went nowhere, and remembering it kept the series from ever
    starting at 0."""
    seen = (counter, frozenset(labels.items()))
    if seen in instruments.zeroed:
        return
    instrument = getattr(instruments, counter)
    if _collected(instrument):
        instruments.zeroed.add(seen)
    for value in values or (None,):
        series = labels if key is None else labels | {key: value}
        instrument.add(0, series)


@contextlib.contextmanager
def handler_timer(consumer: str) -> Iterator[None]:
    """Time one run of a handler, also one that raised."""
    instruments = _instruments()
    if instruments is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        instruments.duration.record(time.perf_counter() - started, {"consumer": consumer})


# -- gauges: values that running relays cache, read by the exporter's callbacks ------------


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

    def __init__(
        self, name: str, database: str, partition: int | None = None, *, recovers: bool = False
    ) -> None:
        self.name = name
        self.labels = relay_labels(name, database, partition)
        self.recovers = recovers  # a change-stream relay: its recoveries are counted
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
        # The gauges exist from now on, also if nothing is ever published.
        relay_started(self.labels, recovers=self.recovers)
        instruments = _instruments()
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
        # Read at start already (_first_read): the next read is due REFRESH_EVERY later.
        refreshed = time.monotonic() if self.backlog is not None else float("-inf")
        while True:
            now = time.monotonic()
            every = REFRESH_EVERY  # read each time: tests tune it
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


def _unobserved() -> None:
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


# -- the inbox's dead letters: read from the inbox in the guard's loop, never in a collection --


class InboxGauge:
    """How many messages a guard's consumer has dead-lettered now, as its inbox last said.

    Read before a consumer's first delivery (``first_read``), again after each dead letter
    the guard makes, and whenever a collection finds the count older than ``REFRESH_EVERY``
    (a requeue from a shell, another process's dead letter): that read runs in the guard's
    own event loop, and its count shows from the next collection on. A count is reported
    once read, and stays until the guard is gone; without a metrics SDK nothing is read.
    """

    def __init__(self, consumer: str, database: str, read: Callable[[], Awaitable[int]]) -> None:
        self.consumer = consumer
        self.labels = {"consumer": consumer, "database": database}
        self.count: int | None = None
        self.read_at = float("-inf")  # time.monotonic() when the count's read started
        self._read = read
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading: asyncio.Task[None] | None = None
        self._again = False  # a read was asked for while one ran: it may predate the change
        self._asked_at = float("-inf")
        with _lock:
            _inboxes.add(self)

    async def first_read(self) -> None:
        """A consumer starts: read the count now (within ``FIRST_READ_TIMEOUT``; an outage
        leaves it to the refreshes), so that its first scrape has it."""
        self._loop = asyncio.get_running_loop()
        if not _gauges_collected():
            return
        started = time.monotonic()
        try:
            self.count = await asyncio.wait_for(self._read(), FIRST_READ_TIMEOUT)
            self.read_at = started
        except Exception as error:  # noqa: BLE001 - the guard itself reports outages
            log.debug("inbox of %s: dead letters not read at start: %s", self.consumer, error)

    def delivered(self, dead_lettered: bool) -> None:
        """After a delivery, in the guard's loop: read again after a dead letter (the alert
        must see the first), or when it was never read, if an SDK collects the gauges."""
        self._loop = asyncio.get_running_loop()
        if (dead_lettered or self.count is None) and _gauges_collected():
            self.refresh()

    def refresh(self) -> None:
        """Read the count in a task of the running loop: one read at a time, and one more
        after it when asked for meanwhile."""
        if self._reading is not None and not self._reading.done():
            self._again = True
            return
        self._reading = asyncio.ensure_future(self._refresh())

    async def _refresh(self) -> None:
        self._again = True
        while self._again:
            self._again = False
            started = time.monotonic()
            try:
                count = await self._read()
            except Exception as error:  # noqa: BLE001 - the next collection asks again
                log.debug("inbox of %s: dead letters not read: %s", self.consumer, error)
                return
            self.count, self.read_at = count, started

    def ask(self) -> None:
        """From a collection, in the exporter's thread: a read in the guard's loop when the
        count is older than ``REFRESH_EVERY``; the collection does not wait for it."""
        loop, now = self._loop, time.monotonic()
        if loop is None or now - max(self.read_at, self._asked_at) < REFRESH_EVERY:
            return
        self._asked_at = now
        with contextlib.suppress(RuntimeError):  # its loop is closed: nothing reads any more
            loop.call_soon_threadsafe(self.refresh)


_inboxes: weakref.WeakSet[InboxGauge] = weakref.WeakSet()


def _gauges_collected() -> bool:
    instruments = _instruments()
    return instruments is not None and _collected(instruments.gauges[0])


def _dead_letters() -> Iterator[tuple[float, dict[str, str]]]:
    with _lock:
        gauges = list(_inboxes)
    # Guards of one consumer in one process read the same records: the latest read says.
    latest: dict[tuple[str, ...], InboxGauge] = {}
    for gauge in gauges:
        gauge.ask()
        key = tuple(gauge.labels.values())
        if gauge.count is not None and (key not in latest or gauge.read_at > latest[key].read_at):
            latest[key] = gauge
    for gauge in latest.values():
        if gauge.count is not None:
            yield gauge.count, gauge.labels


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


def _observable_gauges(meter: Any) -> list[Any]:
    """The observable gauges, on ``meter``."""
    gauges: list[tuple[str, str, str, Callable[[], Iterator[tuple[float, dict[str, str]]]]]] = [
        ("mongo_outbox_pending_events", "", "Pending outbox events", _pending),
        ("mongo_outbox_oldest_pending_age", "s", "Age of the oldest pending event", _oldest),
        ("mongo_outbox_parked_events", "", "Parked outbox events", _parked),
        ("mongo_outbox_checkpoint_lag", "s", "Time since the last checkpoint", _lag),
        ("mongo_outbox_relay_active", "", "Relays that publish now (leader)", _active),
        ("mongo_outbox_relay_state", "", "Relays in each state", _states),
        ("mongo_outbox_inbox_dead_letters", "", "Messages a consumer dead-lettered", _dead_letters),
    ]
    return [
        meter.create_observable_gauge(
            name, callbacks=[_callback(values)], unit=unit, description=text
        )
        for name, unit, text, values in gauges
    ]
