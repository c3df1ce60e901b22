"""The fault matrix: every command the library sends, hit by each of MongoDB's fault classes.

A cell is one command (a row: the writes of both modes and of the sync API, the relay's claim,
settle and requeue, the change-stream relay's leader lease, checkpoint, ``aggregate`` and
``getMore``, the group's member lease, the inbox's writes, ``commitTransaction`` and
``abortTransaction``) and one fault class (a column, ``tests/support/faults.py``), injected with
the ``failCommand`` fail point, narrowed to the client under test's ``appName`` and armed the
moment that client is about to send the command. Every cell checks the same invariants, after
the fault and a recovery without it:

- nothing committed is lost: each event a write reported saved (or stored, when the write
  raised) is published;
- nothing uncommitted is published: the published events are exactly the stored ones (an event
  saved in a transaction aborted on purpose never appears), and a write is all or nothing;
- effects happen once through the inbox: the published events, duplicates included, go through
  ``inbox_guard``, and each effect is stored once;
- order per aggregate holds: the first publication of each event follows its sequence;
- the caller gets a clear error (an ``OutboxError`` or a ``PyMongoError`` with a message) or a
  retry (a relay keeps running, an inbox delivery answers ``RETRY`` and says why);
- no hot loop: the fail point is entered a bounded number of times while the fault lasts (a
  relay's fault stays on for ``WINDOW``; a write's or a delivery's hits once) and the client
  sends a bounded number of commands meanwhile.

Writes, requeues and deliveries are hit once (``times: 1``): their caller decides on a retry.
Relays are hit for ``WINDOW`` (``alwaysOn``, then off), as a server that fails for a while.
``python -m tests.faults`` runs this module and prints the matrix; docs/failures.md has it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import OperationFailure, PyMongoError

from mongo_outbox import (
    Backoff,
    ConcurrencyError,
    Event,
    Inbox,
    Outbox,
    OutboxError,
    PollingRelay,
    RelayGroup,
    RelaySettings,
    inbox_guard,
)
from mongo_outbox._inbox.outcomes import Outcome
from mongo_outbox.changestream import ChangeStreamRelay
from mongo_outbox.publishers import MemoryPublisher
from mongo_outbox.sync import Outbox as SyncOutbox
from tests.support.faults import (
    FAULTS,
    Fault,
    Target,
    Trigger,
    first_set,
    in_collection,
)
from tests.support.outboxes import assert_in_order, save_aborted
from tests.support.servers import MongoServer
from tests.support.waiting import until

# Two minutes in all, cheap cell by cell: `make faults` runs it, `make test-fast` leaves it out.
pytestmark = pytest.mark.faults

SELECTION = 2_000  # ms: a closed connection must not cost PyMongo's 30 s server selection
WINDOW = 0.2  # seconds a relay's fault lasts
HOT_LOOP = 20  # fail point entries a relay may make in WINDOW: a retry every 10 ms at most
ONE_SHOT = 30  # commands a write or a delivery may send after its fault (retries included)
FAST = Backoff(initial=0.02, maximum=0.1)
SETTINGS = RelaySettings(
    batch_size=10, publish_timeout=0.25, claim_lease=0.5, max_attempts=None, backoff=FAST
)
CLAIM_LEASE_MS = 500
LEADER_LEASE = 0.6
MEMBER_LEASE = 0.7  # at least 2.5 times publish_timeout
RECOVERY = 15.0  # seconds a cell may take to publish everything once the fault is off


# -- the rows ---------------------------------------------------------------------------------


def _in_transaction(command: Any) -> bool:
    return command.get("autocommit") is False


def _aggregate_write(command: Any) -> bool:
    return bool(command["findAndModify"] == "orders")


def _collection_claim(command: Any) -> bool:
    return command["update"] == "outbox" and "claim" in first_set(command)


def _collection_settle(command: Any) -> bool:
    return command["update"] == "outbox" and first_set(command).get("status") == "published"


def _embedded_claim(command: Any) -> bool:
    return command["update"] == "orders" and "_outbox_claim" in first_set(command)


def _embedded_settle(command: Any) -> bool:
    updates = command.get("updates") or [{}]
    return command["update"] == "orders" and isinstance(updates[0].get("u"), list)


def _requeue(command: Any) -> bool:
    return command["update"] == "outbox" and first_set(command).get("status") == "pending"


def _renewal(command: Any) -> bool:
    return command["update"] == "outbox_relays" and set(first_set(command)) == {"lease_until"}


def _checkpoint(command: Any) -> bool:
    return command["update"] == "outbox_relays" and "token" in first_set(command)


def _change_stream(command: Any) -> bool:
    pipeline = command.get("pipeline") or [{}]
    return "$changeStream" in pipeline[0]


def _inbox_finish(command: Any) -> bool:
    return command["update"].startswith("inbox") and first_set(command).get("status") == "done"


WRITES = {
    "collection": [
        Target("save:aggregate", "findAndModify", "the aggregate's write in the save's "
               "transaction (collection mode)", _aggregate_write),
        Target("save:entries", "insert", "the outbox entries' insert in the save's transaction",
               lambda c: c["insert"] == "outbox" and _in_transaction(c)),
        Target("save:commit", "commitTransaction", "the save's commit"),
    ],
    "embedded": [
        Target("save:embedded", "findAndModify", "the embedded save's single-document write",
               _aggregate_write),
    ],
    "sync-collection": [
        Target("sync:entries", "insert", "the sync API's outbox insert in its transaction",
               lambda c: c["insert"] == "outbox" and _in_transaction(c)),
        Target("sync:commit", "commitTransaction", "the sync API's commit"),
    ],
    "sync-embedded": [
        Target("sync:embedded", "findAndModify", "the sync API's embedded save",
               _aggregate_write),
    ],
    "abort": [
        Target("save:abort", "abortTransaction", "the abort of a save refused by "
               "expected_version (ConcurrencyError)"),
    ],
}  # fmt: skip
RELAYS = {
    "collection": [
        Target("claim", "update", "the polling relay's claim (collection mode)",
               _collection_claim),
        Target("settle", "update", "the polling relay's settle: published, after the broker "
               "confirmed (collection mode)", _collection_settle),
    ],
    "embedded": [
        Target("claim:embedded", "update", "the polling relay's claim (embedded mode)",
               _embedded_claim),
        Target("settle:embedded", "update", "the polling relay's settle (embedded mode)",
               _embedded_settle),
    ],
}  # fmt: skip
REQUEUE = Target("requeue", "update", "requeue() of a parked event", _requeue)
STREAMS = [
    Target("leader-lease", "findAndModify", "the change-stream relay's leader lease taken",
           in_collection("outbox_relays")),
    Target("lease-renewal", "update", "the change-stream relay's leader lease renewed",
           _renewal),
    Target("checkpoint", "update", "the change-stream relay's checkpoint (resume token)",
           _checkpoint),
    Target("stream:aggregate", "aggregate", "the change stream's aggregate", _change_stream),
    Target("stream:getMore", "getMore", "the change stream's getMore",
           lambda c: c.get("collection") == "outbox"),
]  # fmt: skip
STARTS_AT_ONCE = {"leader-lease", "stream:aggregate"}  # sent as the relay starts
MEMBER = Target("member-lease", "update", "the relay group's member lease (its heartbeat)",
                in_collection("outbox_relay_members"))  # fmt: skip
INBOXES = {
    True: [
        Target("inbox:insert", "findAndModify", "the inbox record's upsert in the handler's "
               "transaction", lambda c: c["findAndModify"] == "inbox" and _in_transaction(c)),
        Target("inbox:commit", "commitTransaction", "the commit of the handler's transaction"),
        Target("inbox:abort", "abortTransaction", "the abort after the handler raised"),
    ],
    False: [
        Target("inbox:insert:leased", "insert", "the leased inbox's claim (insert)",
               in_collection("inbox")),
        Target("inbox:update:leased", "update", "the leased inbox's done mark (update)",
               _inbox_finish),
    ],
}  # fmt: skip


def cells(targets: list[Target], *extra: Any) -> Iterator[Any]:
    """Every fault for each target, a fault that cannot hit it left out saying why."""
    for target in targets:
        for fault in FAULTS:
            reason = target.applies(fault)
            marks = [pytest.mark.skip(reason=f"not a cell: {reason}")] if reason else []
            yield pytest.param(*extra, target, fault, id=f"{target.name}-{fault.name}", marks=marks)


# -- the harness ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def admin(mongo: MongoServer) -> Iterator[MongoClient[Any]]:
    """Configures the fail points: a client of another appName, which they never hit. Skips the
    module where the server refuses configureFailPoint (a replica set without test commands)."""
    client: MongoClient[Any]
    with MongoClient(
        mongo.uri, appName="fault-matrix-admin", serverSelectionTimeoutMS=SELECTION
    ) as client:
        try:
            client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
        except OperationFailure as error:
            pytest.skip(f"the server refuses configureFailPoint ({error}): enableTestCommands=1")
        yield client
        client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})


@dataclass
class Cell:
    """The client under test of one cell, listened to by its trigger."""

    client: AsyncMongoClient[Any]
    trigger: Trigger
    app: str

    def db(self, name: str) -> Any:
        return self.client[name]


@pytest.fixture
def make_cell(
    admin: MongoClient[Any], mongo: MongoServer
) -> Iterator[Callable[[Target, Fault, Any, int], Cell]]:
    made: list[Cell] = []

    def make(target: Target, fault: Fault, mode: Any, lease_ms: int) -> Cell:
        app = f"cell-{uuid.uuid4().hex[:10]}"
        trigger = Trigger(admin, target, fault.fail_point(target.command, app, lease_ms), mode)
        options: dict[str, Any] = {}
        if fault.socket_timeout_ms is not None:
            options["socketTimeoutMS"] = fault.socket_timeout_ms
        client: AsyncMongoClient[Any] = AsyncMongoClient(
            mongo.uri,
            appName=app,
            tz_aware=True,
            serverSelectionTimeoutMS=SELECTION,
            event_listeners=[trigger],
            **options,
        )
        cell = Cell(client, trigger, app)
        made.append(cell)
        return cell

    yield make
    for cell in made:
        cell.trigger.off()


async def close(cell: Cell) -> None:
    cell.trigger.off()
    await cell.client.close()


def assert_clear(error: BaseException | None) -> None:
    """The caller's error, if any, is one of the library's or of the driver's, and says what."""
    if error is not None:
        assert isinstance(error, (OutboxError, PyMongoError)), f"unclear error: {error!r}"
        assert str(error), f"an error without a message: {error!r}"


def entry_id(entry: dict[str, Any]) -> str:
    return str(entry.get("id", entry.get("_id")))


async def stored_events(db: Any, mode: str) -> list[str]:
    """The ids of every outbox entry stored, in either mode, pending or published."""
    if mode == "collection":
        return [str(e["_id"]) async for e in db.outbox.find({}, {"_id": 1})]
    return [entry_id(e) async for doc in db.orders.find() for e in doc.get("_outbox") or []]


async def consumed_once(db: Any, published: list[Event], expected: set[str]) -> None:
    """Every published event, duplicates included, through an inbox: each effect stored once."""
    inbox = Inbox(db, consumer="matrix", transactional=True)

    @inbox_guard(inbox)
    async def record(event: Event, session: Any) -> None:
        await db.effects.insert_one({"event": event.id}, session=session)

    for event in published:
        outcome = (await record.handle(event)).outcome
        assert outcome in (Outcome.HANDLED, Outcome.DUPLICATE), outcome
    effects = [doc["event"] async for doc in db.effects.find()]
    assert sorted(effects) == sorted(expected), "an effect is missing or happened twice"


async def drained(db: Any, outbox: Outbox) -> list[Event]:
    """What a relay without faults publishes now."""
    publisher = MemoryPublisher()
    relay = PollingRelay(outbox, publisher, settings=SETTINGS)
    while await relay.drain():
        pass
    return publisher.events


# -- writes: both modes and the sync API --------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "target", "fault"),
    [p for kind, targets in WRITES.items() for p in cells(targets, kind)],
)
async def test_write_cell(
    db: Any, make_cell: Any, mongo: MongoServer, kind: str, target: Target, fault: Fault
) -> None:
    """A write hit once: it returns with everything stored, or raises a clear error with all
    or nothing stored; what is stored is published and consumed once."""
    mode = "embedded" if "embedded" in kind else "collection"
    mine = Outbox(db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
    await mine.ensure_indexes()
    events = [Event(type="placed"), Event(type="paid")]
    before: set[str] = set()
    if kind == "abort":  # the aggregate exists: expected_version=0 refuses the save
        first = await mine.save_with_events(None, db.orders, {"_id": "o-1"}, [Event(type="new")])
        before = {e.id for e in first.events}
    cell = make_cell(target, fault, {"times": 1}, CLAIM_LEASE_MS)
    error: BaseException | None = None
    returned = False
    try:
        cell.trigger.arm()
        if kind.startswith("sync"):
            returned = await asyncio.to_thread(
                sync_save, mongo.uri, cell, db.name, mode, events, fault
            )
        else:
            outbox = Outbox(cell.db(db.name), mode=mode, collections=["orders"])  # type: ignore[arg-type]
            options = {"expected_version": 0} if kind == "abort" else {}
            await outbox.save_with_events(
                None, cell.db(db.name).orders, {"_id": "o-1", "total": 2}, events, **options
            )
            returned = True
    except Exception as raised:  # noqa: BLE001 - the cell judges what the caller got
        error = raised
    finally:
        await close(cell)
    assert cell.trigger.fired, f"the cell never hit {target.what}"
    assert cell.trigger.hits == 1 and cell.trigger.sent <= ONE_SHOT, cell.trigger.after
    assert_clear(error)
    stored = await stored_events(db, mode)
    new = set(stored) - before
    assert len(stored) == len(set(stored)), "an event was stored twice"
    if kind == "abort":
        assert isinstance(error, ConcurrencyError), f"the refusal was lost: {error!r}"
        assert new == set(), "a refused save stored its events"
    elif returned:
        assert new == {e.id for e in events}, "a save that returned lost its events"
    else:
        assert new in (set(), {e.id for e in events}), f"a partial write: {new}"
    if new or before:
        document = await db.orders.find_one({"_id": "o-1"})
        assert document is not None and document["_version"] == 1
    published = await drained(db, mine)
    assert {e.id for e in published} == set(stored)
    await consumed_once(db, published, set(stored))


def sync_save(
    uri: str, cell: Cell, name: str, mode: str, events: list[Event], fault: Fault
) -> bool:
    """The sync API's save on a sync client of the cell's appName and listener."""
    options: dict[str, Any] = {}
    if fault.socket_timeout_ms is not None:
        options["socketTimeoutMS"] = fault.socket_timeout_ms
    with MongoClient(
        uri,
        appName=cell.app,
        tz_aware=True,
        serverSelectionTimeoutMS=SELECTION,
        event_listeners=[cell.trigger],
        **options,
    ) as client:
        outbox = SyncOutbox(client[name], mode=mode, collections=["orders"])  # type: ignore[arg-type]
        outbox.save_with_events(None, client[name].orders, {"_id": "o-1", "total": 2}, events)
    return True


# -- relays: the polling relay, the change-stream relay, a group ------------------------------


@dataclass
class World:
    """Events saved before (or while) a relay under test runs, and one that must never appear."""

    db: Any
    outbox: Outbox  # the test's own, without faults
    saved: list[Event]
    doomed: str

    async def unsettled(self) -> int:
        if self.outbox.mode == "collection":
            return int(await self.db.outbox.count_documents({"status": {"$ne": "published"}}))
        return sum([len(d.get("_outbox") or []) async for d in self.db.orders.find()])


async def world(db: Any, mode: str = "collection", partitions: int = 1) -> World:
    outbox = Outbox(db, mode=mode, collections=["orders"], partitions=partitions)  # type: ignore[arg-type]
    await outbox.ensure_indexes()
    doomed = await save_aborted(outbox, db, 99)
    return World(db, outbox, [], doomed)


async def save(world: World, saves: int = 2) -> None:
    """Two aggregates, ``saves`` saves each of one event, interleaved."""
    for step in range(saves):
        for order in (1, 2):
            saved = await world.outbox.save_with_events(
                None, world.db.orders, {"_id": order, "step": step}, [Event(type=f"s{step}")]
            )
            world.saved += saved.events


async def recovered(world: World, publisher: MemoryPublisher, cell: Cell) -> None:
    """The fault is off once it lasted WINDOW; wait until everything saved was published and
    settled, then check the invariants that do not depend on the relay."""

    async def explain() -> str:
        published = {e.id for e in publisher.events}
        missing = [e.id for e in world.saved if e.id not in published]
        return f"missing {missing}, unsettled {await world.unsettled()}, sent {cell.trigger.after}"

    await until(lambda: cell.trigger.fired, timeout=10, explain=explain)
    await asyncio.sleep(WINDOW)  # the fault's duration, not a wait for something to happen
    cell.trigger.off()
    assert cell.trigger.hits is not None and cell.trigger.hits <= HOT_LOOP, (
        f"a hot loop: the fail point was entered {cell.trigger.hits} times in {WINDOW}s"
    )

    async def settled() -> bool:
        published = {e.id for e in publisher.events}
        return published >= {e.id for e in world.saved} and await world.unsettled() == 0

    await until(settled, timeout=RECOVERY, explain=explain)


async def holds(world: World, publisher: MemoryPublisher) -> None:
    assert world.doomed not in {e.id for e in publisher.events}, "an aborted event was published"
    assert_in_order(publisher.events, world.saved, once=False)
    await consumed_once(world.db, publisher.events, {e.id for e in world.saved})


async def stop(relay: Any, task: asyncio.Task[None]) -> None:
    """Stop the relay; it must still be running: a fault is retried, never the end of it."""
    assert not task.done(), f"the relay ended: {task.exception() if task.done() else ''}"
    relay.stop()
    await asyncio.wait_for(task, 10)


@pytest.mark.parametrize(
    ("mode", "target", "fault"),
    [p for mode, targets in RELAYS.items() for p in cells(targets, mode)],
)
async def test_polling_relay_cell(
    db: Any, make_cell: Any, mode: str, target: Target, fault: Fault
) -> None:
    """The relay keeps running through WINDOW of the fault, without a hot loop, then publishes
    every committed event, in order per aggregate, nothing uncommitted, each effect once."""
    saved = await world(db, mode)
    await save(saved)
    cell = make_cell(target, fault, "alwaysOn", CLAIM_LEASE_MS)
    publisher = MemoryPublisher()
    outbox = Outbox(cell.db(db.name), mode=mode, collections=["orders"])  # type: ignore[arg-type]
    relay = PollingRelay(outbox, publisher, settings=SETTINGS, interval=0.05)
    cell.trigger.arm()
    task = asyncio.create_task(relay.run())
    try:
        await recovered(saved, publisher, cell)
        await stop(relay, task)
    finally:
        relay.stop()
        await asyncio.wait({task}, timeout=10)
        await close(cell)
    await holds(saved, publisher)


@pytest.mark.parametrize(("target", "fault"), list(cells(STREAMS)))
async def test_change_stream_relay_cell(
    db: Any, make_cell: Any, target: Target, fault: Fault
) -> None:
    """As the polling relay's cells, for the change-stream relay's own commands: it keeps
    running (or stands by and takes its lease back), and publishes what was committed."""
    saved = await world(db)
    lease_ms = int(LEADER_LEASE * 1000)
    cell = make_cell(target, fault, "alwaysOn", lease_ms)
    publisher = MemoryPublisher()
    relay = ChangeStreamRelay(
        Outbox(cell.db(db.name)),
        publisher,
        name=f"cs-{cell.app}",
        settings=SETTINGS,
        leader_lease=LEADER_LEASE,
        sweep_interval=60.0,
    )
    if target.name in STARTS_AT_ONCE:
        cell.trigger.arm()
    task = asyncio.create_task(relay.run())
    try:
        if target.name not in STARTS_AT_ONCE:
            # Following the stream, so that what is saved next comes through it.
            await until(lambda: "getMore" in cell.trigger.seen, timeout=10)
            cell.trigger.arm()
        await save(saved)
        await recovered(saved, publisher, cell)
        await stop(relay, task)
    finally:
        relay.stop()
        await asyncio.wait({task}, timeout=10)
        await close(cell)
    await holds(saved, publisher)


@pytest.mark.parametrize(("target", "fault"), list(cells([MEMBER])))
async def test_relay_group_cell(db: Any, make_cell: Any, target: Target, fault: Fault) -> None:
    """A group's member whose heartbeat fails gives its partitions up and takes them back: every
    committed event is published once the fault is off, in order per aggregate."""
    saved = await world(db, partitions=2)
    await save(saved)
    cell = make_cell(target, fault, "alwaysOn", int(MEMBER_LEASE * 1000))
    publisher = MemoryPublisher()
    group = RelayGroup(
        Outbox(cell.db(db.name), partitions=2),
        publisher,
        name=f"g-{cell.app}",
        settings=SETTINGS,
        member_lease=MEMBER_LEASE,
        interval=0.1,
    )
    cell.trigger.arm()
    task = asyncio.create_task(group.run())
    try:
        await recovered(saved, publisher, cell)
        await stop(group, task)
    finally:
        group.stop()
        await asyncio.wait({task}, timeout=10)
        await close(cell)
    await holds(saved, publisher)


# -- requeue and the inbox: hit once, the caller retries ----------------------------------


@pytest.mark.parametrize(("target", "fault"), list(cells([REQUEUE])))
async def test_requeue_cell(db: Any, make_cell: Any, target: Target, fault: Fault) -> None:
    """requeue() hit once returns or raises a clear error; asked again, as an operator would
    after an error, the parked event comes back and is published and consumed once."""
    saved = await world(db)
    await save(saved, saves=1)
    refused = saved.saved[0]
    refusing = MemoryPublisher(
        fail=lambda e: RuntimeError("refused") if e.id == refused.id else None
    )
    parking = PollingRelay(saved.outbox, refusing, settings=RelaySettings(max_attempts=1))
    await parking.publish_batch()
    assert [e["_id"] for e in await parking.parked()] == [refused.id]
    cell = make_cell(target, fault, {"times": 1}, CLAIM_LEASE_MS)
    relay = PollingRelay(Outbox(cell.db(db.name)), MemoryPublisher(), settings=SETTINGS)
    error: BaseException | None = None
    try:
        cell.trigger.arm()
        await relay.requeue([refused.id])
    except Exception as raised:  # noqa: BLE001 - the cell judges what the caller got
        error = raised
    finally:
        await close(cell)
    assert cell.trigger.fired and cell.trigger.hits == 1, cell.trigger.after
    assert cell.trigger.sent <= ONE_SHOT
    assert_clear(error)
    if error is not None:
        await parking.requeue([refused.id])
    published = refusing.events + await drained(db, saved.outbox)
    assert {e.id for e in published} == {e.id for e in saved.saved}
    assert saved.doomed not in {e.id for e in published}
    assert await saved.unsettled() == 0
    await consumed_once(db, published, {e.id for e in saved.saved})


@pytest.mark.parametrize(
    ("transactional", "target", "fault"),
    [p for transactional, targets in INBOXES.items() for p in cells(targets, transactional)],
)
async def test_inbox_cell(
    db: Any, make_cell: Any, transactional: bool, target: Target, fault: Fault
) -> None:
    """A delivery hit once answers HANDLED, or RETRY saying why; redelivered until it is
    handled (or found handled: a delivery told to retry had done it), the effect is stored
    once and a later delivery is a DUPLICATE. In leased mode the effect is written
    idempotently on the message id (docs/inbox.md: when the done mark is lost, the handler
    runs again once its claim runs out), and runs at most twice."""
    cell = make_cell(target, fault, {"times": 1}, CLAIM_LEASE_MS)
    mine = cell.db(db.name)
    inbox = Inbox(mine, consumer="cell", transactional=transactional, processing_lease=0.5)
    runs: list[str] = []
    fails_first = target.name == "inbox:abort"

    @inbox_guard(inbox)
    async def handler(event: Event, session: Any) -> None:
        runs.append(event.id)
        if fails_first and len(runs) == 1:
            raise RuntimeError("the handler's first attempt fails")
        # Transactional: counted, to see it commit once. Leased: idempotent on the message id,
        # as that mode's handlers must be.
        change = {"$inc": {"writes": 1}} if transactional else {"$set": {"done": True}}
        await mine.effects.update_one({"_id": event.id}, change, upsert=True, session=session)

    event = Event(type="placed", aggregate_type="orders", aggregate_id=1)
    outcomes = []
    try:
        await handler.prepare()
        cell.trigger.arm()
        for _ in range(8):
            result = await handler.handle(event)
            outcomes.append(result.outcome)
            if result.outcome in (Outcome.HANDLED, Outcome.DUPLICATE):
                break  # a duplicate: handled by a delivery told to retry (its reply was lost)
            assert result.outcome is Outcome.RETRY and result.error, result
            await asyncio.sleep(min(result.delay, 0.6))  # the broker's redelivery delay
        cell.trigger.off()
        assert outcomes[-1] in (Outcome.HANDLED, Outcome.DUPLICATE), outcomes
        assert (await handler.handle(event)).outcome is Outcome.DUPLICATE
    finally:
        await close(cell)
    assert cell.trigger.fired and cell.trigger.hits == 1, cell.trigger.after
    assert cell.trigger.sent <= ONE_SHOT
    effects = await db.effects.find().to_list(None)
    assert [e["_id"] for e in effects] == [event.id], "the effect is missing or stored twice"
    if transactional:
        assert effects[0]["writes"] == 1, "a handler's writes committed twice"
    else:
        assert len(runs) <= 2, runs
