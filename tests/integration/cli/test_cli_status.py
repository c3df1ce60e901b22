"""``mongo-outbox status``, the real console script, against an outbox with a backlog, a parked
entry, an active and a stopped change-stream relay, and dead-lettered inbox messages."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from mongo_outbox import (
    DeadLettered,
    Event,
    Inbox,
    Outbox,
    PoisonMessage,
    PollingRelay,
    RelaySettings,
    inbox_guard,
)
from mongo_outbox._relay.lease import FencedLease
from mongo_outbox.publishers import MemoryPublisher
from tests.support.cli import cli
from tests.support.servers import MongoServer


async def dead_letter(db: Any, consumer: str, n: int) -> None:
    @inbox_guard(Inbox(db, consumer=consumer, transactional=False))
    async def handler(event: Event, session: Any) -> None:
        raise PoisonMessage("cannot bill")

    for _ in range(n):
        with pytest.raises(DeadLettered):
            await handler(Event(type="order.placed"))


@pytest.mark.parametrize("mode", ["collection", "embedded"])
async def test_status_shows_backlog_parked_relays_and_inbox_failures(
    mongo: MongoServer, db: Any, mode: str
) -> None:
    outbox = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    await outbox.save_with_events(None, db.orders, {"_id": 1}, [Event(type="poison")])
    broken = MemoryPublisher(fail=lambda e: ValueError("cannot encode"))
    await PollingRelay(outbox, broken, settings=RelaySettings(max_attempts=1)).drain()
    for n in (2, 3):
        await outbox.save_with_events(None, db.orders, {"_id": n}, [Event(type="placed")])
    active = FencedLease(db.outbox_relays, "orders-relay", timedelta(seconds=60))
    assert await active.acquire()
    await active.save({"_data": "t1"})
    stopped = FencedLease(db.outbox_relays, "old-relay", timedelta(seconds=60))
    assert await stopped.acquire()
    await stopped.save({"_data": "t0"})
    await stopped.release()
    await dead_letter(db, "billing", 2)
    await dead_letter(db, "mailer", 1)
    target = [f"--uri={mongo.uri}", f"--db={db.name}", f"--mode={mode}", "--collections=orders"]

    ran = await cli("status", *target, "--json")
    assert ran.code == 0, ran.output
    report = json.loads(ran.out)
    assert report["pending"] == 2 and report["parked"] == 1
    assert 0 <= report["oldest_pending_age_seconds"] < 60
    relays = {r["name"]: r for r in report["relays"]}
    assert relays["orders-relay"]["state"] == "active"
    assert relays["orders-relay"]["lease_holder"] == active.owner
    assert 0 <= relays["orders-relay"]["checkpoint_age_seconds"] < 60
    assert relays["old-relay"]["state"] == "inactive"
    assert relays["old-relay"]["lease_holder"] is None
    assert report["inbox_failures"] == [
        {"consumer": "billing", "failed": 2},
        {"consumer": "mailer", "failed": 1},
    ]

    text = await cli("status", *target)
    assert text.code == 0, text.output
    lines = text.out.splitlines()
    assert lines[0].startswith(f"outbox {db.name}")
    assert lines[2].split()[0] == "2" and lines[2].split()[-1] == "1"  # pending, parked
    [orders] = [line.split() for line in lines if line.strip().startswith("orders-relay")]
    assert orders[1:3] == ["active", active.owner]
    [old] = [line.split() for line in lines if line.strip().startswith("old-relay")]
    assert old[1:3] == ["inactive", "-"]
    assert ["billing", "2"] in [line.split() for line in lines]


async def test_status_of_an_empty_database_says_so(mongo: MongoServer, db: Any) -> None:
    ran = await cli("status", f"--uri={mongo.uri}", f"--db={db.name}")
    assert ran.code == 0, ran.output
    assert "none recorded" in ran.out and "inbox failures\n  none" in ran.out


CREDENTIALS = (
    "?tlsCertificateKeyFilePassword=k3y-passw0rd&authMechanism=MONGODB-AWS"
    "&authMechanismProperties=AWS_SESSION_TOKEN:s3ssion-t0ken"
)


@pytest.mark.slow
async def test_a_failure_line_shows_no_credential_of_the_uri_query(mongo: MongoServer) -> None:
    ran = await cli("status", f"--uri=mongodb://app:app-passw0rd@127.0.0.1:1/shop{CREDENTIALS}")

    assert ran.code == 1, ran.output
    assert "is unreachable" in ran.err
    assert "tlsCertificateKeyFilePassword=***" in ran.err
    for secret in ("app-passw0rd", "k3y-passw0rd", "s3ssion-t0ken"):
        assert secret not in ran.output


async def test_a_uri_the_driver_refuses_fails_in_one_line_without_its_credentials() -> None:
    uri = "mongodb://127.0.0.1:1/shop?tls=true&tlsCertificateKeyFile=/no/such.pem" + CREDENTIALS

    ran = await cli("status", f"--uri={uri}")

    assert ran.code == 1, ran.output
    assert ran.err.startswith("mongo-outbox: bad MongoDB URI"), ran.output
    assert "Traceback" not in ran.err
    for secret in ("k3y-passw0rd", "s3ssion-t0ken"):
        assert secret not in ran.output
