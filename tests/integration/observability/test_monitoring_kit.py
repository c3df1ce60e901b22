"""The packaged Grafana dashboard and alert rules name series that live processes really export:
a relay (the real console script, ``mongo-outbox relay --metrics-port``) publishing to the real
NATS, one of its publishes failing, and a consumer whose inbox guard handles, skips, retries and
dead-letters messages against the test MongoDB, served by the same endpoint the relay uses.
Both are scraped over HTTP as Prometheus would.

The inbox's series come from consumers, not relays: a relay process never records them, so a
small consumer process stands for the application's own (docs/operating.md).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from typing import Any

import pytest
import yaml

from mongo_outbox import Event, Outbox
from mongo_outbox.monitoring import ALERTS, DASHBOARD
from tests.integration.cli.test_cli_metrics import free_port, scrape
from tests.support.cli import Service, environment
from tests.support.metrics import get, samples
from tests.support.servers import NATS_URL, MongoServer
from tests.support.waiting import until

pytest.importorskip("opentelemetry.exporter.prometheus", reason="needs the prometheus extra")

SERIES = re.compile(r"\bmongo_outbox_[a-z_]+\b")
GROUPED = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
MATCHED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
# Only a relay group's members carry ``partition`` (metrics.relay_labels); the relay here is
# not one.
GROUP_ONLY = {"partition"}
# Labels Prometheus gives series itself: ``job`` and ``instance`` to each scraped one (and its
# ``up``), ``alertname`` to its ``ALERTS``.
PROMETHEUS = {"job", "instance", "alertname"}

CONSUMER = """
import asyncio, sys
from pymongo import AsyncMongoClient
from mongo_outbox import DeadLettered, Event, Inbox, PoisonMessage, RetryLater, inbox_guard
from mongo_outbox.cli.metrics import Endpoint

async def main(uri, name, port):
    endpoint = Endpoint("127.0.0.1", port)   # the relay's endpoint: an SDK and /metrics
    client = AsyncMongoClient(uri, tz_aware=True)
    inbox = Inbox(client[name], consumer="billing", transactional=True)
    await inbox.ensure_indexes()

    @inbox_guard(inbox, max_attempts=2)
    async def bill(event, session):
        if event.type == "poison":
            raise PoisonMessage("no customer")
        if event.type == "flaky" and event.payload.setdefault("runs", 0) == 0:
            event.payload["runs"] = 1
            raise RuntimeError("billing service down")

    paid = Event(type="order.paid", aggregate_type="orders", aggregate_id="o-1")
    await bill(paid)                    # handled
    await bill(paid)                    # duplicate
    flaky = Event(type="flaky", aggregate_type="orders", aggregate_id="o-2", payload={})
    try:
        await bill(flaky)               # retry
    except RetryLater:
        pass
    await bill(flaky)                   # handled
    try:
        await bill(Event(type="poison", aggregate_type="orders", aggregate_id="o-3"))
    except DeadLettered:
        pass
    print("consumed", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await client.close()
    endpoint.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def exported(text: str) -> dict[str, set[str]]:
    """Each ``mongo_outbox_*`` sample name of an exposition and the label names it carries."""
    found: dict[str, set[str]] = {}
    for name, labels, _ in samples(text):
        if name.startswith("mongo_outbox_"):
            found.setdefault(name, set()).update(labels)
    return found


async def relay_exposition(mongo: MongoServer, db: Any, stream: str) -> str:
    """A relay's /metrics once it published events, failed to publish one, and refreshed its
    backlog gauges."""
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    for n in range(3):
        await outbox.save_with_events(
            None, db.orders, {"_id": f"o-{n}"}, [Event(type=f"{stream}.placed")]
        )
    # No stream takes this subject: a failed publish, counted by reason.
    await outbox.save_with_events(None, db.orders, {"_id": "lost"}, [Event(type="nowhere")])
    port = free_port()
    relay = await Service(
        "relay",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        "--name=dashboard",
        f"--nats={NATS_URL}",
        "--subject={type}",
        f"--metrics-port={port}",
        "--metrics-host=127.0.0.1",
    ).start()
    text: list[str] = []
    try:

        async def published_and_failed() -> bool:
            answer = await scrape(relay, f"http://127.0.0.1:{port}/metrics")
            if answer is None:
                return False
            text[:] = [answer[1]]
            names = exported(answer[1])
            published = [v for n, _, v in samples(answer[1]) if n == "mongo_outbox_published_total"]
            # The backlog's gauges are there from the first scrape; the checkpoint's lag once
            # the relay checkpointed.
            refreshed = {
                "mongo_outbox_pending_events",
                "mongo_outbox_checkpoint_lag_seconds",
            } <= names.keys()
            return published == [3] and "mongo_outbox_publish_failures_total" in names and refreshed

        await until(published_and_failed, timeout=60, every=0.25)
        ran = await relay.stop(signal.SIGTERM, timeout=20)
    finally:
        relay.kill()
    assert ran.code == 0, ran.output
    return text[0]


async def consumer_exposition(mongo: MongoServer, db: Any) -> str:
    """A consumer's /metrics once its guard handled, skipped, retried and dead-lettered."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CONSUMER,
        mongo.uri,
        db.name,
        str(port),
        env=environment(),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None and process.stdin is not None
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        if line != b"consumed\n":
            assert process.stderr is not None
            raise AssertionError(f"the consumer said {line!r}: {await process.stderr.read()!r}")
        status, text = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
        process.stdin.close()
        await asyncio.wait_for(process.wait(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert status == 200 and process.returncode == 0
    return text


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard panel's target and every alert rule."""
    found: list[tuple[str, str]] = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r}", target["expr"]))
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            found.append((f"alert {rule['alert']}", rule["expr"]))
    return found


async def test_every_panel_and_alert_names_series_that_live_processes_export(
    mongo: MongoServer, db: Any, nats_stream: str
) -> None:
    relay = exported(await relay_exposition(mongo, db, nats_stream))
    consumed = await consumer_exposition(mongo, db)
    consumer = exported(consumed)
    live = {name: relay.get(name, set()) | consumer.get(name, set()) for name in relay | consumer}
    # The consumer's guard recorded every outcome the dashboard and alerts look at.
    outcomes = {
        labels["outcome"]
        for name, labels, _ in samples(consumed)
        if name == "mongo_outbox_inbox_messages_total"
    }
    assert outcomes == {"handled", "duplicate", "retry", "dead_lettered"}
    used: set[str] = set()
    for where, expr in queries():
        names = set(SERIES.findall(expr))
        assert names, f"{where} names no mongo_outbox series: {expr}"
        missing = names - live.keys()
        assert not missing, f"{where} names series no live process exports: {missing}"
        used |= names
        labels = set().union(*(live[name] for name in names)) | GROUP_ONLY | PROMETHEUS
        grouped = {label.strip() for group in GROUPED.findall(expr) for label in group.split(",")}
        matched = set(MATCHED.findall(expr))
        assert (grouped | matched) - {""} <= labels, f"{where}: labels {expr}"
    # And the other way round: every series a live process exports is on the dashboard or in
    # an alert (the histogram through its buckets; ``_created`` is the exporter's timestamp).
    histogram = "mongo_outbox_handler_duration_seconds"
    unused = {n for n in live if not n.endswith("_created")} - used
    assert unused == {f"{histogram}_count", f"{histogram}_sum"}
