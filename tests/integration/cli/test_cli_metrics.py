"""``mongo-outbox relay --metrics-port``: the real console script in a subprocess, against the
test MongoDB and the real NATS, scraped over HTTP as Prometheus would: the exact metric names
and values while it publishes, ``/healthz`` 200 while it works and 503 once it failed, and a
missing extra or a port in use refused in one line before anything is done."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from typing import Any

import pytest

from mongo_outbox import Event, Outbox
from mongo_outbox.metrics import FAILURE_REASONS
from tests.support.cli import Service, cli, environment, until_active
from tests.support.metrics import get, samples, value
from tests.support.servers import NATS_URL, MongoServer
from tests.support.waiting import until

pytest.importorskip("opentelemetry.exporter.prometheus", reason="needs the prometheus extra")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def scrape(service: Service, url: str) -> tuple[int, str] | None:
    """GET ``url`` from the relay; None while it does not answer yet (failing if it exited)."""
    assert service.process is not None
    if service.process.returncode is not None:
        ran = await service.stop(0)
        raise AssertionError(f"the relay exited {ran.code}: {ran.output}")
    try:
        return await asyncio.to_thread(get, url)
    except OSError:
        return None


async def save_orders(outbox: Outbox, db: Any, n: int) -> list[Event]:
    events: list[Event] = []
    for i in range(n):
        saved = await outbox.save_with_events(
            None, db.orders, {"_id": f"o-{i}"}, [Event(type="placed", payload={"n": i})]
        )
        events += saved.events
    return events


def relay_args(mongo: MongoServer, db: Any, name: str, subject: str, port: int) -> list[str]:
    return [
        "relay",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        f"--name={name}",
        f"--nats={NATS_URL}",
        f"--subject={subject}",
        f"--metrics-port={port}",
        "--metrics-host=127.0.0.1",
    ]


async def test_the_relay_serves_prometheus_metrics_and_health_while_it_publishes(
    mongo: MongoServer, db: Any, nats_client: Any, nats_stream: str
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    saved = await save_orders(outbox, db, 5)  # before the relay starts: its sweep publishes them
    port = free_port()
    args = relay_args(mongo, db, "metered", f"{nats_stream}.{{type}}", port)
    args.remove(f"--metrics-port={port}")  # given through its environment twin instead
    relay = await Service(*args, env=environment(MONGO_OUTBOX_METRICS_PORT=str(port))).start()
    base = f"http://127.0.0.1:{port}"
    metrics: list[str] = []
    try:

        async def everything_published() -> bool:
            answer = await scrape(relay, f"{base}/metrics")
            if answer is None:
                return False
            metrics[:] = [answer[1]]
            published = value(answer[1], "mongo_outbox_published_total", relay="metered")
            pending = value(answer[1], "mongo_outbox_pending_events", relay="metered")
            return published == len(saved) and pending == 0

        await until(everything_published, timeout=60, every=0.25)
        health = await scrape(relay, f"{base}/healthz")
        missing = await scrape(relay, f"{base}/nothing")
        ran = await relay.stop(signal.SIGTERM, timeout=20)
    finally:
        relay.kill()
    assert ran.code == 0, ran.output
    [text] = metrics
    assert value(text, "mongo_outbox_published_total", relay="metered") == 5
    assert value(text, "mongo_outbox_pending_events", relay="metered") == 0
    assert value(text, "mongo_outbox_oldest_pending_age_seconds", relay="metered") == 0
    assert value(text, "mongo_outbox_parked_events", relay="metered") == 0
    assert value(text, "mongo_outbox_relay_active", relay="metered") == 1
    assert value(text, "mongo_outbox_relay_state", relay="metered", state="active") == 1
    assert value(text, "mongo_outbox_relay_state", relay="metered", state="failed") == 0
    assert value(text, "mongo_outbox_relay_recoveries_total", relay="metered") == 0  # a 1st start
    lag = value(text, "mongo_outbox_checkpoint_lag_seconds", relay="metered")
    assert lag is not None and 0 <= lag < 60
    # Nothing failed: each failure series is there at 0 (so that a first failure is an
    # increase an alert sees); the names are the documented ones.
    for reason in FAILURE_REASONS:
        failed = value(text, "mongo_outbox_publish_failures_total", relay="metered", reason=reason)
        assert failed == 0
    names = {name for name, _, _ in samples(text) if name.startswith("mongo_outbox_")}
    assert names == {
        "mongo_outbox_published_total",
        "mongo_outbox_publish_failures_total",
        "mongo_outbox_relay_recoveries_total",
        "mongo_outbox_pending_events",
        "mongo_outbox_oldest_pending_age_seconds",
        "mongo_outbox_parked_events",
        "mongo_outbox_checkpoint_lag_seconds",
        "mongo_outbox_relay_active",
        "mongo_outbox_relay_state",
    }
    assert health == (200, "active\n")
    assert missing is not None and missing[0] == 404
    info = await nats_client.jetstream().stream_info(nats_stream)
    assert info.state.messages == 5
    assert f"serving /metrics and /healthz on http://127.0.0.1:{port}" in ran.err


async def test_a_standby_relay_is_healthy_and_not_active(
    mongo: MongoServer, db: Any, nats_stream: str
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    subject = f"{nats_stream}.{{type}}"
    leader = await Service(*relay_args(mongo, db, "pair", subject, free_port())).start()
    port = free_port()
    standby: Service | None = None
    try:
        await until_active(db, "pair", leader, timeout=60)
        standby = await Service(*relay_args(mongo, db, "pair", subject, port)).start()
        base = f"http://127.0.0.1:{port}"
        text: list[str] = []

        async def standing_by() -> bool:
            assert standby is not None
            health = await scrape(standby, f"{base}/healthz")
            metrics = await scrape(standby, f"{base}/metrics")
            if health != (200, "standby\n") or metrics is None:
                return False
            text[:] = [metrics[1]]
            return True

        await until(standing_by, timeout=60, every=0.2)
        stopped = await standby.stop(signal.SIGTERM, timeout=20)
    finally:
        leader.kill()
        if standby is not None:
            standby.kill()
    assert stopped.code == 0, stopped.output
    [metrics] = text
    assert value(metrics, "mongo_outbox_relay_active", relay="pair") == 0
    assert value(metrics, "mongo_outbox_relay_state", relay="pair", state="standby") == 1


async def test_a_failed_relay_answers_503_until_it_exits(
    mongo: MongoServer, db: Any, nats_stream: str
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    # A checkpoint whose resume token was overwritten by hand with a string: no server takes
    # that as a token (MongoDB answers TypeMismatch), and the relay fails with
    # ChangeStreamError, as it must for what no retry can fix.
    await db.outbox_relays.insert_one({"_id": "broken", "token": "not-a-resume-token"})
    port = free_port()
    args = relay_args(mongo, db, "broken", f"{nats_stream}.{{type}}", port)
    relay = await Service(*args).start()  # the default linger: a 1 m scrape must see it
    base = f"http://127.0.0.1:{port}"
    answers: list[tuple[int, str]] = []
    try:

        async def unhealthy() -> bool:
            answer = await scrape(relay, f"{base}/healthz")
            answers.append(answer or (0, ""))
            return answer is not None and answer[0] == 503 and answer[1] == "failed\n"

        await until(unhealthy, timeout=60, every=0.1)
        answer = await scrape(relay, f"{base}/metrics")
        ran = await relay.stop(signal.SIGTERM, timeout=20)  # ends the linger at once
    finally:
        relay.kill()
    assert answer is not None and answer[0] == 200
    assert value(answer[1], "mongo_outbox_relay_state", relay="broken", state="failed") == 1
    assert value(answer[1], "mongo_outbox_relay_active", relay="broken") == 0
    assert ran.code == 1
    assert (
        "relay broken failed: ChangeStreamError: relay broken: the change stream failed" in ran.err
    )
    # Two scrapes at Prometheus' default 1 m interval see the failure, whatever their phase.
    assert "/healthz answers 503 for 150s" in ran.err


MISSING = """
import sys
sys.modules[{module!r}] = None  # as if the prometheus extra were not installed: imports fail
from mongo_outbox.cli import main
main()
"""


@pytest.mark.parametrize(
    "module",
    ["prometheus_client", "opentelemetry.sdk.metrics", "opentelemetry.exporter.prometheus"],
)
async def test_metrics_port_without_the_extra_fails_in_one_line_before_anything(
    mongo: MongoServer, db: Any, module: str
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await save_orders(outbox, db, 1)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        MISSING.format(module=module),
        *relay_args(mongo, db, "never", "x.{type}", free_port()),
        env=environment(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 1
    assert out == b""
    [line] = err.decode().splitlines()
    assert line.startswith(
        "mongo-outbox: --metrics-port needs pip install 'mongo-outbox[prometheus]'"
    )
    assert module.split(".")[0] in line
    assert await db.outbox.count_documents({"status": "pending"}) == 1
    assert await db.outbox_relays.count_documents({}) == 0


async def test_the_endpoint_serves_on_an_ipv6_address(
    mongo: MongoServer, db: Any, nats_stream: str
) -> None:
    await Outbox(db).ensure_indexes()
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = int(probe.getsockname()[1])
    args = relay_args(mongo, db, "six", f"{nats_stream}.{{type}}", port)
    relay = await Service(*args[:-1], "--metrics-host=::1").start()
    try:

        async def healthy() -> bool:
            return await scrape(relay, f"http://[::1]:{port}/healthz") == (200, "active\n")

        await until(healthy, timeout=60, every=0.2)
        ran = await relay.stop(signal.SIGTERM, timeout=20)
    finally:
        relay.kill()
    assert ran.code == 0, ran.output
    assert f"serving /metrics and /healthz on http://[::1]:{port}" in ran.err


async def test_a_metrics_port_in_use_fails_in_one_line_before_relaying(
    mongo: MongoServer, db: Any
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await save_orders(outbox, db, 1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        ran = await cli(*relay_args(mongo, db, "never", "x.{type}", port), timeout=60)
    assert ran.code == 1
    [line] = ran.err.splitlines()
    assert line.startswith(f"mongo-outbox: cannot serve metrics on 127.0.0.1:{port}: ")
    assert await db.outbox.count_documents({"status": "pending"}) == 1
    assert await db.outbox_relays.count_documents({}) == 0


@pytest.mark.parametrize("kind", [[], ["--polling"]], ids=["changestream", "polling"])
async def test_the_first_scrape_of_a_relay_that_just_started_has_its_backlog(
    mongo: MongoServer, db: Any, nats_stream: str, kind: list[str]
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await save_orders(outbox, db, 3)
    port = free_port()
    relay = await Service(
        *relay_args(mongo, db, "fresh", f"{nats_stream}.{{type}}", port), *kind
    ).start()
    base = f"http://127.0.0.1:{port}"
    try:

        async def healthy() -> bool:
            answer = await scrape(relay, f"{base}/healthz")
            return answer is not None and answer[0] == 200

        await until(healthy, timeout=30, every=0.05)
        answer = await scrape(relay, f"{base}/metrics")  # the first one
        ran = await relay.stop(signal.SIGTERM, timeout=20)
    finally:
        relay.kill()
    assert ran.code == 0, ran.output
    assert answer is not None and answer[0] == 200
    for gauge in (
        "mongo_outbox_pending_events",
        "mongo_outbox_oldest_pending_age_seconds",
        "mongo_outbox_parked_events",
    ):
        assert value(answer[1], gauge, relay="fresh") is not None, gauge
