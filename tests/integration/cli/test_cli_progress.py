"""Progress of the command line's long work, through the real console script: with stderr on a
real pseudo-terminal, ``parked requeue``, ``replay``, ``ensure-indexes`` and ``relay --drain``
redraw one line with counts and rate and end on the final count; with stderr on a pipe they
write plain lines (every ``MONGO_OUTBOX_PROGRESS_EVERY`` seconds), and nothing for short work.
The result on stdout is the same either way."""

from __future__ import annotations

import asyncio
import os
import pty
import uuid
from typing import Any

from mongo_outbox import Event, Outbox
from tests.integration.cli.test_cli_recovery import park, target
from tests.integration.cli.test_cli_replay import published_history
from tests.support.cli import COMMAND, Ran, cli, environment, save_orders, stream_ids
from tests.support.servers import NATS_URL, MongoServer

EVERY_LINE = environment(MONGO_OUTBOX_PROGRESS_EVERY="0")  # a plain line at every count


async def on_terminal(*args: str, timeout: float = 60) -> Ran:
    """Run ``mongo-outbox ARGS`` with its stderr on a pseudo-terminal, stdout on a pipe."""
    master, slave = pty.openpty()
    try:
        process = await asyncio.create_subprocess_exec(
            *COMMAND,
            *args,
            env=environment(),
            stdout=asyncio.subprocess.PIPE,
            stderr=slave,
        )
    finally:
        os.close(slave)  # the child holds it: the master reads EOF (EIO) once the child exits

    def terminal_output() -> bytes:
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every slave side is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        assert process.stdout is not None
        out, err = await asyncio.wait_for(
            asyncio.gather(process.stdout.read(), asyncio.to_thread(terminal_output)), timeout
        )
        await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        os.close(master)
    assert process.returncode is not None
    return Ran(process.returncode, out.decode(), err.decode())


def redrawn(ran: Ran) -> list[str]:
    """The states of the terminal's progress line, in order."""
    return [part.replace("\x1b[K", "").strip() for part in ran.err.split("\r") if part.strip()]


async def test_parked_requeue_shows_its_progress(mongo: MongoServer, db: Any) -> None:
    await park(db, "collection")  # four parked events
    ran = await on_terminal("parked", "requeue", "--all", *target(mongo, db))
    assert ran.code == 0, ran.output
    assert ran.out.strip() == "requeued 4 parked events"
    states = redrawn(ran)
    assert all(state.startswith("requeue: ") and "/4 events (" in state for state in states)
    assert states[-1].startswith("requeue: 4/4 events (100%), ")
    assert ran.err.endswith("\r\n")


async def test_parked_requeue_on_a_pipe_writes_plain_lines_or_nothing(
    mongo: MongoServer, db: Any
) -> None:
    await park(db, "collection")
    quiet = await cli("parked", "requeue", "--type=poison", *target(mongo, db))
    assert quiet.code == 0 and quiet.err == "", quiet.output  # short work: nothing added
    ran = await cli("parked", "requeue", "--all", *target(mongo, db), env=EVERY_LINE)
    assert ran.code == 0, ran.output
    assert ran.out.strip() == "requeued 1 parked events"
    lines = ran.err.splitlines()
    assert lines[-1].startswith("requeue: 1/1 events (100%), ")
    assert "\r" not in ran.err and "\x1b" not in ran.err


async def test_replay_shows_its_progress(mongo: MongoServer, db: Any) -> None:
    await published_history(db)
    where = [f"--uri={mongo.uri}", f"--db={db.name}", f"--nats={NATS_URL}", "--since=1h"]
    ran = await on_terminal("replay", "--dry-run", *where)
    assert ran.code == 0, ran.output
    assert ran.out.splitlines()[0] == "would republish 9 events of 3 aggregates"
    assert redrawn(ran)[-1].startswith("replay: 9 events, ")
    plain = await cli("replay", "--dry-run", *where, env=EVERY_LINE)
    assert plain.out == ran.out
    assert plain.err.splitlines()[-1].startswith("replay: 9 events, ")


async def test_ensure_indexes_shows_the_documents_indexed(mongo: MongoServer, db: Any) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await save_orders(outbox, db, 4)  # four outbox entries
    ran = await on_terminal("ensure-indexes", f"--uri={mongo.uri}", f"--db={db.name}")
    assert ran.code == 0, ran.output
    assert ran.out.startswith(f"{db.name}.outbox: ")
    assert redrawn(ran)[-1].startswith("ensure-indexes: 4/4 documents (100%), ")


async def test_relay_drain_publishes_what_is_due_with_its_progress_and_exits(
    mongo: MongoServer, db: Any, nats_client: Any, nats_stream: str
) -> None:
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    saved = await save_orders(outbox, db, 3)
    args = [
        "relay",
        "--drain",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        f"--nats={NATS_URL}",
        f"--subject={nats_stream}.{{type}}",
    ]
    ran = await on_terminal(*args)
    assert ran.code == 0, ran.output
    assert ran.out.strip() == (
        "published 3 events; 0 pending (due later, waiting for a retry, or saved meanwhile)"
    )
    drawn = [s for s in redrawn(ran) if s.startswith("drain: ")]
    assert drawn[-1].startswith("drain: 3/3 events (100%), ")
    assert sorted(await stream_ids(nats_client, nats_stream, 3)) == sorted(e.id for e in saved)
    assert await db.outbox.count_documents({"status": "pending"}) == 0

    more = await outbox.save_with_events(None, db.orders, {"_id": "x"}, [Event(type="placed")])
    plain = await cli(*args, "--polling", env=EVERY_LINE)
    assert plain.code == 0, plain.output
    assert plain.out.startswith("published 1 events; 0 pending")
    progress = [line for line in plain.err.splitlines() if line.startswith("drain: ")]
    assert progress[-1].startswith("drain: 1/1 events (100%), ")
    assert "\r" not in plain.err
    assert more.events[0].id in await stream_ids(nats_client, nats_stream, 4)


def nowhere() -> str:
    """A subject no stream takes: every publish to it fails."""
    return f"--subject=nostream{uuid.uuid4().hex[:8]}.{{type}}"


async def drain(mongo: MongoServer, db: Any, *more: str, env: dict[str, str] | None = None) -> Ran:
    where = [f"--uri={mongo.uri}", f"--db={db.name}", f"--nats={NATS_URL}"]
    return await cli("relay", "--drain", *where, *more, env=env)


async def test_a_drain_whose_publishes_fail_exits_1(mongo: MongoServer, db: Any) -> None:
    # No stream takes the subject: every publish fails. A job must see that it did not work.
    outbox = Outbox(db)
    await outbox.ensure_indexes()
    await save_orders(outbox, db, 2)
    ran = await drain(mongo, db, nowhere())
    assert ran.code == 1, ran.output
    assert ran.out.startswith("published 0 events; 2 publishes failed")
    assert ran.err.splitlines()[-1] == (
        "mongo-outbox: the drain published 0 events and 2 publishes failed: 0 parked, the rest "
        "pending for their next attempt"
    )
    assert await db.outbox.count_documents({"status": "pending"}) == 2  # kept for a retry


async def test_a_relay_given_collections_in_collection_mode_says_it(
    mongo: MongoServer, db: Any
) -> None:
    # An environment with MONGO_OUTBOX_COLLECTIONS and no MONGO_OUTBOX_MODE: the events are
    # in the aggregates, and the relay would look at the empty outbox collection in silence.
    embedded = Outbox(db, mode="embedded", collections=["orders"])
    await save_orders(embedded, db, 2)
    ran = await drain(mongo, db, env=environment(MONGO_OUTBOX_COLLECTIONS="orders"))
    assert ran.code == 0, ran.output
    assert ran.out.startswith("published 0 events; 0 pending")
    assert (
        "--collections (orders) is for --mode embedded: this relay publishes the outbox "
        "collection 'outbox' (collection mode); add --mode embedded (MONGO_OUTBOX_MODE)"
    ) in ran.err
    assert f"database {db.name} has none of outbox yet: relaying it all the same" in ran.err
    embedded = await drain(mongo, db, nowhere(), "--mode=embedded", "--collections=orders")
    assert embedded.code == 1  # no stream takes the subject: its publishes fail
    assert embedded.out.startswith("published 0 events; 2 publishes failed")
    assert "has none of" not in embedded.err


async def test_relay_drain_refuses_partitions_in_one_line(mongo: MongoServer, db: Any) -> None:
    ran = await cli(
        "relay",
        "--drain",
        "--partitions=2",
        f"--uri={mongo.uri}",
        f"--db={db.name}",
        f"--nats={NATS_URL}",
    )
    assert ran.code == 1 and ran.out == ""
    [line] = ran.err.splitlines()
    assert line == (
        "mongo-outbox: --drain and --partitions exclude each other: a drain publishes every "
        "partition at once, run it without --partitions"
    )
