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
last checkpoint's), so they keep growing when a relay is stuck.

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

``reason`` is one of ``FAILURE_REASONS``.

The handler histogram asks for buckets from 1 ms to 60 s; opentelemetry-api older than 1.30
cannot ask, and the SDK's default buckets (meant for milliseconds) apply unless a ``View`` sets
them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

from mongo_outbox import _gauges
from mongo_outbox._gauges import RelayGauges as RelayGauges  # used as metrics.RelayGauges
from mongo_outbox._gauges import relay_labels as relay_labels

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
# Handler durations from a millisecond to the server's 60 s transaction lifetime.
HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


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
        self.gauges = _gauges.observe(meter)


_UNBOUND: Any = object()
_bound: _Instruments | None = _UNBOUND


def use(meter_provider: Any = None) -> None:
    """Record into ``meter_provider`` (an OpenTelemetry ``MeterProvider``) from now on; ``None``
    goes back to the global one (``opentelemetry.metrics.set_meter_provider``), the default.
    Without the ``otel`` extra, ``None`` is accepted and nothing is recorded."""
    global _bound
    _bound = _bind(meter_provider) if meter_provider is not None else _global()
    _gauges.unobserved()  # until the new provider collects


def _bind(meter_provider: Any) -> _Instruments | None:
    try:
        from opentelemetry import metrics
    except ImportError:
        if meter_provider is not None:
            from mongo_outbox.errors import ConfigurationError

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
    from mongo_outbox.errors import BrokerFullError, InvalidEventError
    from mongo_outbox.publishers.base import unavailable

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


def inbox_outcome(consumer: str, outcome: str) -> None:
    instruments = _instruments()
    if instruments is not None:
        instruments.inbox.add(1, {"consumer": consumer, "outcome": outcome})


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
