"""What the metrics hooks cost the relay: ``PollingRelay.drain()`` throughput with the hooks
off (as without the ``otel`` extra: the baseline), with the OpenTelemetry API and no SDK (the
default once the extra is installed), and with an SDK that records (an ``InMemoryMetricReader``);
then each hook's own cost per call, set against the time of a relay round.

Runs alternate the three settings on fresh databases, and the medians are compared. The relay
calls ``published()`` once per round and ``publish_failed()`` once per failed publish; the
inbox guard calls ``inbox_outcome()`` and ``handler_timer()`` once per delivery.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import client, fresh_db, header, median, say, standalone
from mongo_outbox import Event, Outbox, PollingRelay, RelaySettings, metrics
from mongo_outbox.errors import BrokerUnavailableError
from mongo_outbox.publishers import MemoryPublisher

AGGREGATES = 300
EVENTS_PER_AGGREGATE = 2
BATCH_SIZE = 100
REPEATS = 3
CALLS = 20_000


def _settings() -> dict[str, Callable[[], Any]]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    def off() -> None:
        metrics._bound = None  # what the hooks see without the otel extra

    def api() -> None:
        metrics.use(None)  # the global provider: none installed here, so a no-op

    def sdk() -> Any:
        reader = InMemoryMetricReader()
        metrics.use(MeterProvider(metric_readers=[reader]))
        return reader

    return {"hooks off": off, "API, no SDK": api, "SDK recording": sdk}


async def drain_rate(uri: str) -> tuple[float, int]:
    """Events per second of one drain of a fresh outbox, and the rounds it took."""
    mongo = client(uri)
    try:
        async with fresh_db(mongo) as db:
            outbox = Outbox(db)
            await outbox.ensure_indexes()
            for n in range(AGGREGATES):
                events = [Event(type="order.placed", payload={"n": n}) for _ in range(2)]
                await outbox.save_with_events(None, db.orders, {"_id": f"o{n}"}, events)
            relay = PollingRelay(
                outbox, MemoryPublisher(), settings=RelaySettings(batch_size=BATCH_SIZE)
            )
            rounds = 0
            start = time.perf_counter()
            while True:
                _, more = await relay.publish_batch()
                rounds += 1
                if not more:
                    break
            elapsed = time.perf_counter() - start
            if relay.stats.published != AGGREGATES * EVENTS_PER_AGGREGATE:
                raise RuntimeError(f"published {relay.stats.published}")
    finally:
        await mongo.close()
    return relay.stats.published / elapsed, rounds


def per_call(hook: Callable[[], None]) -> float:
    """Nanoseconds per call of ``hook``."""
    start = time.perf_counter()
    for _ in range(CALLS):
        hook()
    return (time.perf_counter() - start) / CALLS * 1e9


def timer() -> None:
    with metrics.handler_timer("billing"):
        pass


DOWN = BrokerUnavailableError("down", event_id="e")
RELAY = metrics.relay_labels("orders-relay", "shop")
HOOKS: dict[str, Callable[[], None]] = {
    "published (per round)": lambda: metrics.published(RELAY, 100),
    "publish_failed (per failure)": lambda: metrics.publish_failed(RELAY, DOWN),
    "inbox_outcome (per delivery)": lambda: metrics.inbox_outcome("billing", "handled"),
    "handler_timer (per handler run)": timer,
}


async def run(uri: str) -> list[str]:
    header("Metrics hooks: relay throughput with them off, with the API alone, with an SDK")
    settings = _settings()
    events = AGGREGATES * EVENTS_PER_AGGREGATE
    say(f"{events} events, batch_size={BATCH_SIZE}, MemoryPublisher; median of {REPEATS} runs")
    rates: dict[str, list[float]] = {name: [] for name in settings}
    rounds = 0
    try:
        for _ in range(REPEATS):
            for name, setting in settings.items():
                setting()
                rate, rounds = await drain_rate(uri)
                rates[name].append(rate)
        costs = {}
        for name, setting in settings.items():
            setting()
            costs[name] = {hook: per_call(call) for hook, call in HOOKS.items()}
    finally:
        metrics.use(None)
    baseline = median(rates["hooks off"])
    lines = []
    for name, values in rates.items():
        line = (
            f"drain {name:<14} {median(values):8.0f} events/s  "
            f"ratio to hooks off {median(values) / baseline:.3f}"
        )
        say(line)
        lines.append(line)
    round_ms = events / baseline / rounds * 1000
    say(f"a round ({BATCH_SIZE} events) takes {round_ms:.1f} ms here")
    for hook in HOOKS:
        line = f"{hook:<32} " + "  ".join(
            f"{name}: {costs[name][hook]:6.0f} ns" for name in settings
        )
        say(line)
        lines.append(line)
    share = costs["SDK recording"]["published (per round)"] / (round_ms * 1e6)
    line = f"published() with an SDK: {share:.5%} of a round"
    say(line)
    lines.append(line)
    return lines


if __name__ == "__main__":
    standalone(run)
