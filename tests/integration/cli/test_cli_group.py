"""``mongo-outbox relay --partitions P``: the console script as a relay group member."""

from __future__ import annotations

import signal
from typing import Any

from mongo_outbox import Outbox
from tests.support.cli import Service, held, lease_of, save_orders, stream_ids
from tests.support.servers import NATS_URL, MongoServer
from tests.support.waiting import until


def member(mongo: MongoServer, db: Any, stream: str, partitions: int) -> Service:
    return Service(
        "relay",
        "--polling",
        "--interval=0.1",
        f"--partitions={partitions}",
        "--member-lease=3",
        "--publish-timeout=1",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        "--mode=embedded",
        "--collections=orders",
        f"--nats={NATS_URL}",
        f"--subject={stream}.{{type}}",
        "--name=orders-group",
    )


async def test_two_members_share_the_partitions_and_stop_on_sigterm(
    mongo: MongoServer, db: Any, nats_client: Any, nats_stream: str
) -> None:
    outbox = Outbox(db, mode="embedded", collections=["orders"], partitions=2)
    await outbox.ensure_indexes()
    saved = await save_orders(outbox, db, 6)
    members = [await member(mongo, db, nats_stream, 2).start() for _ in range(2)]
    try:

        async def shared() -> bool:
            leases = [await lease_of(db, f"orders-group/{k}") for k in range(2)]
            owners = {doc.get("owner") for doc in leases if held(doc)}
            return len(owners) == 2  # each member holds one partition

        await until(shared, timeout=30, every=0.1)
        ids = await stream_ids(nats_client, nats_stream, len(saved))
        ran = [await m.stop(signal.SIGTERM, timeout=15) for m in members]
    finally:
        for m in members:
            m.kill()
    assert sorted(ids) == sorted(e.id for e in saved)
    assert all(r.code == 0 for r in ran), [r.output for r in ran]
    leases = [await lease_of(db, f"orders-group/{k}") for k in range(2)]
    assert not any(held(doc) for doc in leases)  # given back, not left to run out


async def test_a_member_with_another_partition_count_is_refused_in_one_line(
    mongo: MongoServer, db: Any, nats_stream: str
) -> None:
    await Outbox(db, mode="embedded", collections=["orders"], partitions=2).ensure_indexes()
    ran = await member(mongo, db, nats_stream, 3).start()
    result = await ran.stop(0, timeout=30)  # signal 0: only wait for it to exit
    assert result.code != 0
    assert "records partitions=2" in result.err and "Traceback" not in result.err
