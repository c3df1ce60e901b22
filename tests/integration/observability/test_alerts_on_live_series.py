"""The alerts that must fire do fire, on the series live processes export: two consumers
(``consume_nats``) and two change-stream relays (the real console script) at once, against the
test MongoDB and the real NATS, and a relay that fails. Each is scraped over HTTP; the scrapes
become ``promtool test rules`` input series as Prometheus stores them, one scrape a minute
(Prometheus' default interval): the exported names, labels and values, with the ``job`` and
``instance`` labels Prometheus adds, its ``up``, and a stale marker for each series of a
target once it is down. So the rules cannot drift from what is exported:

- a consumer's first dead letter fires ``InboxDeadLetters`` for that consumer alone, from the
  next scrape, and an hour later still (the message is still dead-lettered);
- one relay of two killed fires ``OutboxRelayTargetDown`` for its target alone, while the other
  takes over (no ``OutboxNoRelayReporting``, no ``OutboxNoActiveRelay``);
- a relay that failed, seen by the scrapes of its ``--metrics-linger`` (the default, read from
  its log) in their worst phase, fires ``OutboxRelayFailed``, and then its target's absence
  ``OutboxRelayTargetDown``.

An alert fires when promtool's evaluation writes its ``ALERTS{alertstate="firing"}`` series,
checked with the exact labels it carries (annotations are alerts_test.yml's to check).
"""

from __future__ import annotations

import asyncio
import math
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from mongo_outbox import Event, Outbox
from mongo_outbox.monitoring import ALERTS
from tests.integration.cli.test_cli_metrics import free_port, relay_args, scrape
from tests.support.cli import Service, environment
from tests.support.metrics import get, samples, value
from tests.support.promtool import promtool_or_skip
from tests.support.servers import NATS_URL, MongoServer
from tests.support.waiting import until

pytest.importorskip("opentelemetry.exporter.prometheus", reason="needs the prometheus extra")

SCRAPE = 60  # seconds: Prometheus' default scrape interval, and the rules' evaluation interval
SEVERITY = {
    rule["alert"]: rule["labels"]["severity"]
    for group in yaml.safe_load(ALERTS.read_text())["groups"]
    for rule in group["rules"]
}

CONSUMERS = """
import asyncio, sys
import nats
from pymongo import AsyncMongoClient
from mongo_outbox import Inbox, PoisonMessage, inbox_guard
from mongo_outbox.cli.metrics import Endpoint
from mongo_outbox.consumers import consume_nats

def guard(inbox, poisoned):
    @inbox_guard(inbox, max_attempts=1)
    async def handle(event, session):
        if poisoned(event):
            raise PoisonMessage("no customer")
    return handle

async def main(uri, name, port, stream):
    client = AsyncMongoClient(uri, tz_aware=True)
    guards = [
        ("billing", guard(Inbox(client[name], consumer="billing", transactional=True),
                          lambda event: event.type.endswith("poison"))),
        ("shipping", guard(Inbox(client[name], consumer="shipping", transactional=True),
                           lambda event: False)),
    ]
    # The SDK comes after the guards are made, as in a service that imports its handlers first.
    endpoint = Endpoint("127.0.0.1", port)
    connection = await nats.connect(sys.argv[5])
    js = connection.jetstream()
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(consume_nats(js, f"{stream}.>", consumer, guard, stop=stop))
        for consumer, guard in guards
    ]
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    stop.set()
    await asyncio.gather(*tasks)
    await connection.close()
    await client.close()
    endpoint.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
"""


# -- from scrapes to promtool's input series ---------------------------------------------------


def series_of(exposition: str) -> dict[str, float]:
    """The ``mongo_outbox_*`` samples of an exposition as promtool series selectors (``_created``
    is the exporter's timestamp of a series, not read by any rule)."""
    found: dict[str, float] = {}
    for name, labels, number in samples(exposition):
        if name.startswith("mongo_outbox_") and not name.endswith("_created"):
            found[selector(name, labels)] = number
    return found


def selector(name: str, labels: dict[str, str]) -> str:
    def quoted(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    return name + "{" + ",".join(f"{k}={quoted(v)}" for k, v in sorted(labels.items())) + "}"


def target(job: str, instance: str, minutes: list[str | None]) -> list[dict[str, str]]:
    """Input series of one scraped target: ``minutes[i]`` is what its /metrics said at minute
    ``i``, ``None`` once it is down (``up`` 0, and each of its series stale, as Prometheus marks
    them at the first failed scrape)."""
    scraped = [None if text is None else series_of(text) for text in minutes]
    keys = sorted({key for found in scraped if found for key in found})
    values: dict[str, list[str]] = {key: [] for key in keys}
    up: list[str] = []
    for minute, found in enumerate(scraped):
        up.append("0" if found is None else "1")
        for key in keys:
            before = scraped[minute - 1] if minute else None
            if found is not None and key in found:
                values[key].append(repr(found[key]))
            elif before is not None and key in before:
                values[key].append("stale")
            else:
                values[key].append("_")
    extra = f'job="{job}",instance="{instance}"'
    inputs = [{"series": f"up{{{extra}}}", "values": " ".join(up)}]
    for key, row in values.items():
        labelled = key[:-1] + ("," if not key.endswith("{}") else "") + extra + "}"
        inputs.append({"series": labelled, "values": " ".join(row)})
    return inputs


def firing(alert: str, at: int, *expected: dict[str, str]) -> dict[str, Any]:
    """A check that ``alert`` fires at minute ``at`` with exactly the ``expected`` labels."""
    return {
        "expr": f'ALERTS{{alertname="{alert}",alertstate="firing"}}',
        "eval_time": f"{at}m",
        "exp_samples": [
            {
                "labels": selector(
                    "ALERTS",
                    {"alertname": alert, "alertstate": "firing", "severity": SEVERITY[alert]}
                    | labels,
                ),
                "value": 1,
            }
            for labels in expected
        ],
    }


def run_promtool(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    path = tmp_path / "live_alerts_test.yml"
    path.write_text(  # DEBUG
        yaml.safe_dump(
            {"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": tests},
            sort_keys=False,
        )
    )
    ran = subprocess.run(
        [promtool_or_skip(), "test", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0 and "SUCCESS" in ran.stdout, ran.stdout + ran.stderr


# -- the live processes ------------------------------------------------------------------------


class Consumers:
    """The consumer process: ``consume_nats`` for billing and shipping, /metrics on ``port``."""

    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process, self.port = process, port

    async def scrape(self) -> str:
        if self.process.returncode is not None:
            assert self.process.stderr is not None
            raise AssertionError(f"the consumers exited: {await self.process.stderr.read()!r}")
        try:
            status, text = await asyncio.to_thread(get, f"http://127.0.0.1:{self.port}/metrics")
        except OSError:
            return ""
        return text if status == 200 else ""


async def scraped_until(service: Service, port: int, condition: Any, timeout: float = 60) -> str:
    found: list[str] = []

    async def holds() -> bool:
        answer = await scrape(service, f"http://127.0.0.1:{port}/metrics")
        if answer is None or answer[0] != 200 or not condition(answer[1]):
            return False
        found[:] = [answer[1]]
        return True

    await until(holds, timeout=timeout, every=0.2)
    return found[0]


async def test_the_alerts_fire_on_the_series_a_live_relay_and_consumer_export(
    mongo: MongoServer, db: Any, nats_stream: str, tmp_path: Path
) -> None:
    promtool_or_skip()
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    consumers_port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CONSUMERS,
        mongo.uri,
        db.name,
        str(consumers_port),
        nats_stream,
        NATS_URL,
        env=environment(),
        stdin=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    consumers = Consumers(process, consumers_port)
    ports = {"a": free_port(), "b": free_port()}
    relays = {
        name: Service(
            *relay_args(mongo, db, "orders", f"{nats_stream}.{{type}}", port),
            "--leader-lease=4",
        )
        for name, port in ports.items()
    }
    broken_port = free_port()
    broken = Service(*relay_args(mongo, db, "broken", f"{nats_stream}.{{type}}", broken_port))
    try:
        # The consumers started: both dead-letter counts read from the inbox (0), and the
        # outcome counters at 0 though the guards were made before the SDK.
        started: list[str] = []

        async def consumers_started() -> bool:
            text = await consumers.scrape()
            started[:] = [text]
            return all(
                value(text, "mongo_outbox_inbox_dead_letters", consumer=c) == 0
                for c in ("billing", "shipping")
            )

        await until(consumers_started, timeout=60, every=0.2)
        before = started[0]
        for consumer in ("billing", "shipping"):
            for outcome in ("handled", "dead_lettered"):
                counted = value(
                    before, "mongo_outbox_inbox_messages_total", consumer=consumer, outcome=outcome
                )
                assert counted == 0, (consumer, outcome, before)

        # Two relays of one name: a publishes, b (started once a leads) stands by.
        def in_state(state: str) -> Any:
            return lambda text: value(text, "mongo_outbox_relay_state", state=state) == 1

        await relays["a"].start()
        first = await scraped_until(relays["a"], ports["a"], in_state("active"))
        await relays["b"].start()
        second = await scraped_until(relays["b"], ports["b"], in_state("standby"))

        # An event billing cannot take: the relay publishes it, billing dead-letters it (its
        # first), shipping handles it.
        await outbox.save_with_events(None, db.orders, {"_id": "o-1"}, [Event(type="order.poison")])
        after: list[str] = []

        async def dead_lettered() -> bool:
            text = await consumers.scrape()
            after[:] = [text]
            handled = value(
                text, "mongo_outbox_inbox_messages_total", consumer="shipping", outcome="handled"
            )
            return (
                value(text, "mongo_outbox_inbox_dead_letters", consumer="billing") == 1
                and handled == 1
            )

        await until(dead_lettered, timeout=60, every=0.2)
        [dead] = after
        assert value(dead, "mongo_outbox_inbox_dead_letters", consumer="shipping") == 0

        # Relay a dies; b takes the lease over.
        relays["a"].kill()
        took_over = await scraped_until(relays["b"], ports["b"], in_state("active"))

        # A relay that fails (a checkpoint whose token no server takes): what it serves while
        # it lingers, and for how long.
        await db.outbox_relays.insert_one({"_id": "broken", "token": "not-a-resume-token"})
        await broken.start()
        failed = await scraped_until(broken, broken_port, in_state("failed"))
        ended = await broken.stop(signal.SIGTERM, timeout=20)
        [linger] = re.findall(r"/healthz answers 503 for ([0-9.]+)s", ended.err)
    finally:
        for relay in (*relays.values(), broken):
            relay.kill()
        if process.returncode is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), 30)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()

    database = db.name
    # Prometheus scrapes each minute; a failed relay is seen by the scrapes that fall inside its
    # linger: in the worst phase, floor(linger / interval) of them.
    seen = math.floor(float(linger) / SCRAPE)
    assert seen >= 2, f"a failed relay lingers {linger}s: {seen} scrapes at {SCRAPE}s see it"
    fails, gone = seen - 1, seen  # the last minute it is seen, the first it is down
    tests: list[dict[str, Any]] = [
        {
            # Two consumers: billing's first dead letter fires, for billing alone, at once
            # and an hour later (it is still dead-lettered).
            "interval": "1m",
            "input_series": target("consumers", "consumers:9464", [before] * 2 + [dead] * 60),
            "promql_expr_test": [
                firing("InboxDeadLetters", 1),
                firing("InboxDeadLetters", 2, {"consumer": "billing", "database": database}),
                firing("InboxDeadLetters", 61, {"consumer": "billing", "database": database}),
            ],
        },
        {
            # Two relays: a (active) is killed at minute 3, b takes over. Only a's target fires.
            "interval": "1m",
            "input_series": [
                *target("relays", "relay-a:9464", [first] * 3 + [None] * 10),
                *target("relays", "relay-b:9464", [second] * 3 + [took_over] * 10),
            ],
            "promql_expr_test": [
                firing("OutboxRelayTargetDown", 4),
                firing("OutboxRelayTargetDown", 5, {"job": "relays", "instance": "relay-a:9464"}),
                firing("OutboxRelayTargetDown", 12, {"job": "relays", "instance": "relay-a:9464"}),
                firing("OutboxNoRelayReporting", 12),
                firing("OutboxNoActiveRelay", 12),
            ],
        },
        {
            # A failed relay seen by `seen` scrapes, then gone: it fires from the first, for 10
            # minutes after the last, and its target's absence fires too.
            "interval": "1m",
            "input_series": target("broken-relays", "relay-c:9464", [failed] * seen + [None] * 15),
            "promql_expr_test": [
                firing("OutboxRelayFailed", 0, {"relay": "broken", "database": database}),
                firing("OutboxRelayFailed", fails, {"relay": "broken", "database": database}),
                firing("OutboxRelayFailed", fails + 9, {"relay": "broken", "database": database}),
                firing("OutboxRelayFailed", fails + 12),
                firing(
                    "OutboxRelayTargetDown",
                    gone + 2,
                    {"job": "broken-relays", "instance": "relay-c:9464"},
                ),
            ],
        },
    ]
    run_promtool(tmp_path, tests)
    import shutil

    shutil.copy(tmp_path / "live_alerts_test.yml", "/tmp/live_alerts_test.yml")
