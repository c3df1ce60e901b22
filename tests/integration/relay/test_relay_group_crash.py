"""A relay group of three member processes, SIGKILLed and restarted at random while a writer
commits and aborts: nothing committed is lost, nothing aborted is published, order per
aggregate holds, and no partition is ever published by two members at once. In both modes; in
the default (collection) mode two writers commit their transactions side by side."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mongo_outbox import Event, Outbox, PollingRelay
from mongo_outbox.publishers import MemoryPublisher
from tests.crash.group_process import PARTITIONS
from tests.support.outboxes import save_aborted
from tests.support.waiting import drained, progressing, until

ROOT = Path(__file__).resolve().parents[3]


def publishes_of(record: Path) -> list[dict[str, Any]]:
    """The publishes the members recorded (a line cut short by a SIGKILL left out)."""
    publishes = []
    for line in record.read_text().splitlines() if record.exists() else []:
        try:
            publishes.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return publishes


def epochs_of(record: Path) -> dict[tuple[int, str, int], list[float]]:
    """Each (partition, member, fence) that published, with the span of its publishes."""
    epochs: dict[tuple[int, str, int], list[float]] = {}
    for p in publishes_of(record):
        span = epochs.setdefault((p["partition"], p["member"], p["fence"]), [p["start"], p["end"]])
        span[0], span[1] = min(span[0], p["start"]), max(span[1], p["end"])
    return epochs


async def what_is_left(db: Any) -> str:
    """What a failure needs to be traced: the entries not yet published, the documents that
    still hold events, and every lease, member and checkpoint, at the deadline."""
    lines = [f"at {time.time():.3f}:"]
    async for entry in db.outbox.find({"status": {"$ne": "published"}}):
        lines.append(f"entry {entry}")
    async for order in db.orders.find({"_outbox.0": {"$exists": True}}):
        lines.append(f"order {order}")
    for name in sorted(await db.list_collection_names()):
        if name.startswith("outbox_") and name != "outbox_event_ids":
            lines += [f"{name} {doc}" async for doc in db[name].find()]
    return "\n".join(lines)


# The writes' and the drains' own stall checks decide; this bounds a hang (90 s at load 8).
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["collection", "embedded"])
@pytest.mark.parametrize("source", ["polling", "changestream"])
async def test_group_members_killed_at_random_lose_nothing_and_never_share_a_partition(
    mongo: Any, db: Any, nats_client: Any, nats_stream: str, tmp_path: Path, source: str, mode: str
) -> None:
    outbox = Outbox(db, mode=mode, collections=["orders"], partitions=PARTITIONS)  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    record = tmp_path / "publishes.jsonl"
    chance = random.Random(14)
    seeds = iter(range(1000))

    async def start() -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.crash.group_process",
            mongo.uri,
            db.name,
            nats_stream,
            str(record),
            str(next(seeds)),
            source,
            mode,
            cwd=ROOT,
        )

    members = [await start() for _ in range(3)]
    committed: list[str] = []
    aborted: list[str] = []
    writing = True
    kills = 0

    async def writer(first: int, writers: int) -> None:
        # At least 300 saves, and on until four kills are over and have moved partitions to
        # members that published on them (more epochs than partitions): however fast the
        # writers are, and however slowly the members start (a fast writer once finished under
        # the first member, before the others had joined). Twenty kills bound it.
        n = first
        while (n < 300 or kills < 4 or len(epochs_of(record)) < PARTITIONS + 2) and kills < 20:
            n += writers
            order = chance.randrange(40)
            if n % 10 == 9:
                aborted.append(await save_aborted(outbox, db, order))
                continue
            saved = await outbox.save_with_events(
                None, db.orders, {"_id": order}, [Event(type="step")]
            )
            committed.append(saved.events[0].id)

    async def write() -> None:
        nonlocal writing
        writers = 2 if mode == "collection" else 1
        await asyncio.gather(*(writer(first, writers) for first in range(writers)))
        writing = False

    async def kill_at_random() -> None:
        # Few, mean kills: one member at a time, sometimes the same twice, sometimes before
        # the group settled from the last one; each restarted at once (with a new member id:
        # it joins as a stranger, and the others give it its share).
        nonlocal kills
        while writing or kills < 3:  # at least three, however fast the writer
            await asyncio.sleep(chance.uniform(1.5, 4.0))
            victim = chance.randrange(len(members))
            members[victim].send_signal(signal.SIGKILL)
            assert await asyncio.wait_for(members[victim].wait(), 10) == -9
            kills += 1
            members[victim] = await start()

    try:
        # However slow the machine, saves and kills go on; a stall of either fails.
        await progressing(
            asyncio.gather(write(), kill_at_random()),
            lambda: len(committed) + len(aborted) + kills,
        )
        status = PollingRelay(outbox, MemoryPublisher())

        async def left() -> int:
            return (await status.status()).pending

        async def all_published() -> None:
            # Claims of 2 s and member leases run out well within a stall of 20 s.
            await drained(left, explain=lambda: what_is_left(db))

        # The dead members' claims and leases run out; the live ones publish the rest.
        await all_published()
        if source == "changestream":
            # A partition's stream checkpoints once it saw a change while watched; a member that
            # took a partition late may have swept all it had. More writes, kills over, until
            # every partition has checkpointed (each round covers them all: 40 aggregates).
            names = [f"orders-group/{k}" for k in range(PARTITIONS)]

            async def checkpointed() -> bool:
                docs = await db.outbox_relays.find({"_id": {"$in": names}}).to_list(None)
                if len(docs) == PARTITIONS and all(d.get("token") for d in docs):
                    return True
                for order in range(40):
                    saved = await outbox.save_with_events(
                        None, db.orders, {"_id": order}, [Event(type="step")]
                    )
                    committed.append(saved.events[0].id)
                return False

            await until(checkpointed, timeout=60, every=2.0)
            await all_published()
    finally:
        for member in members:
            if member.returncode is None:
                member.send_signal(signal.SIGKILL)
                await member.wait()
    assert kills >= 3

    js = nats_client.jetstream()
    count = (await js.stream_info(nats_stream)).state.messages
    sub = await js.subscribe(f"{nats_stream}.>", ordered_consumer=True)
    received = [Event.from_json((await sub.next_msg(timeout=5)).data) for _ in range(count)]
    await sub.unsubscribe()
    ids = [e.id for e in received]
    # JetStream drops republished duplicates by event id, so each id appears once.
    assert sorted(ids) == sorted(committed) and not set(ids) & set(aborted)
    sequences: dict[Any, list[int]] = {}
    for event in received:
        sequences.setdefault(event.aggregate_id, []).append(event.sequence or 0)
    assert all(s == sorted(s) for s in sequences.values())

    # Fencing: every publish started under a lease its member held, and per partition the
    # epochs (member, fence) follow one another: the last publish of one ended before the
    # first of the next began.
    publishes = publishes_of(record)
    assert len(publishes) >= len(committed) and all(p["fence"] is not None for p in publishes)
    epochs = epochs_of(record)
    if source == "changestream":
        # Each partition followed its own stream and checkpointed where it was, under the kills.
        docs = await db.outbox_relays.find({"_id": {"$in": names}}).to_list(None)
        assert len(docs) == PARTITIONS and all(d.get("token") for d in docs)
    # The kills did move partitions: more holders than partitions published.
    assert len(epochs) >= PARTITIONS + 2, f"{len(epochs)} epochs in {kills} kills"
    for k in range(PARTITIONS):
        mine = sorted((fence, span) for (p, _, fence), span in epochs.items() if p == k)
        for (_, before), (_, after) in itertools.pairwise(mine):
            assert before[1] <= after[0], f"partition {k}: two members published at once"
