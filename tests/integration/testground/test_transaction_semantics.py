"""MongoDB's transaction semantics, checked with plain PyMongo and no mongo-outbox code.

Whatever MongoDB the suite runs on (a replica set with ``MONGODB_URI``, or the emulator) must
behave as MongoDB documents in "In-progress Transactions and Write Conflicts": snapshot reads,
conflicts per document raised at the write (code 112, ``TransientTransactionError``), first
writer wins, a plain write waits for the transaction holding its document, a commit applies
exactly its own changes and an aborted transaction leaves nothing. Every other test of the suite
relies on this, so it is proved here first, with outcomes a real replica set gives too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from bson import Int64
from pymongo import AsyncMongoClient
from pymongo.errors import DuplicateKeyError, OperationFailure, PyMongoError

WRITE_CONFLICT = 112
NO_SUCH_TRANSACTION = 251


def is_transient(error: PyMongoError) -> bool:
    return error.has_error_label("TransientTransactionError")


@pytest.mark.parametrize("order", list(itertools.permutations("ABC")), ids="".join)
async def test_transactions_inserting_distinct_ids_all_commit_and_lose_nothing(
    client: AsyncMongoClient[Any], db: Any, order: tuple[str, ...]
) -> None:
    await db.a.insert_one({"_id": "before-a"})
    await db.b.insert_one({"_id": "before-b"})
    sessions = {name: client.start_session() for name in "ABC"}
    for name, session in sessions.items():
        await session.start_transaction()
        await db.a.insert_one({"_id": f"{name}-a"}, session=session)
        await db.b.insert_one({"_id": f"{name}-b"}, session=session)
    # Not visible to anyone else before they commit.
    assert await db.a.distinct("_id") == ["before-a"]
    for name in order:
        await sessions[name].commit_transaction()
        assert await db.a.count_documents({"_id": f"{name}-a"}) == 1
    for session in sessions.values():
        await session.end_session()
    assert sorted(await db.a.distinct("_id")) == ["A-a", "B-a", "C-a", "before-a"]
    assert sorted(await db.b.distinct("_id")) == ["A-b", "B-b", "C-b", "before-b"]


async def test_the_second_writer_of_a_document_conflicts_at_its_write_and_the_first_wins(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.c.insert_one({"_id": 1, "n": 0, "by": []})
    first, second = client.start_session(), client.start_session()
    await first.start_transaction()
    await second.start_transaction()
    await db.c.update_one({"_id": 1}, {"$push": {"by": "first"}}, session=first)
    with pytest.raises(OperationFailure) as raised:
        await db.c.find_one_and_update({"_id": 1}, {"$push": {"by": "second"}}, session=second)
    assert raised.value.code == WRITE_CONFLICT
    assert raised.value.details is not None
    assert raised.value.details["codeName"] == "WriteConflict"
    assert is_transient(raised.value)
    # The conflicted transaction is aborted: its next command, and its commit, are refused.
    with pytest.raises(OperationFailure) as refused:
        await db.other.insert_one({"_id": "late"}, session=second)
    assert refused.value.code == NO_SUCH_TRANSACTION
    await second.abort_transaction()
    await first.commit_transaction()
    assert await db.c.find_one({"_id": 1}) == {"_id": 1, "n": 0, "by": ["first"]}
    assert await db.other.count_documents({}) == 0
    for session in (first, second):
        await session.end_session()


async def test_a_write_to_a_document_committed_after_the_snapshot_conflicts(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.c.insert_many([{"_id": 1, "n": 0}, {"_id": 2, "n": 0}])
    late = client.start_session()
    await late.start_transaction()
    assert (await db.c.find_one({"_id": 1}, session=late))["n"] == 0  # its snapshot
    async with client.start_session() as early:
        await early.with_transaction(
            lambda s: db.c.update_one({"_id": 1}, {"$inc": {"n": 1}}, session=s)
        )
    # Another document is no conflict; the one committed after the snapshot is.
    await db.c.update_one({"_id": 2}, {"$inc": {"n": 10}}, session=late)
    with pytest.raises(OperationFailure) as raised:
        await db.c.update_one({"_id": 1}, {"$inc": {"n": 10}}, session=late)
    assert raised.value.code == WRITE_CONFLICT and is_transient(raised.value)
    await late.abort_transaction()
    await late.end_session()
    assert await db.c.find().sort("_id").to_list() == [{"_id": 1, "n": 1}, {"_id": 2, "n": 0}]


async def test_a_plain_write_waits_for_the_transaction_that_holds_its_document(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.c.insert_one({"_id": 1, "n": 0})
    async with client.start_session() as session:
        await session.start_transaction()
        await db.c.update_one({"_id": 1}, {"$inc": {"n": 1}}, session=session)
        plain = asyncio.create_task(db.c.update_one({"_id": 1}, {"$inc": {"n": 10}}))
        done, _ = await asyncio.wait({plain}, timeout=0.5)
        assert not done, "a plain write went past a transaction holding its document"
        await session.commit_transaction()
    await plain
    assert await db.c.find_one({"_id": 1}) == {"_id": 1, "n": 11}


async def test_a_plain_write_after_the_snapshot_makes_the_transactions_write_conflict(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.c.insert_one({"_id": 1, "n": 0})
    async with client.start_session() as session:
        await session.start_transaction()
        assert (await db.c.find_one({"_id": 1}, session=session))["n"] == 0
        await db.c.update_one({"_id": 1}, {"$inc": {"n": 10}})
        with pytest.raises(OperationFailure) as raised:
            await db.c.update_one({"_id": 1}, {"$set": {"n": 1}}, session=session)
        assert raised.value.code == WRITE_CONFLICT and is_transient(raised.value)
        await session.abort_transaction()
    assert await db.c.find_one({"_id": 1}) == {"_id": 1, "n": 10}


async def test_a_transaction_reads_its_snapshot_and_its_own_writes(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.c.insert_one({"_id": 1, "n": 0})
    async with client.start_session() as session:
        await session.start_transaction()
        assert await db.c.find({}, session=session).to_list() == [{"_id": 1, "n": 0}]
        await db.c.update_one({"_id": 1}, {"$inc": {"n": 5}})  # plain, after the snapshot
        await db.c.insert_one({"_id": 2, "n": 0})
        await db.c.insert_one({"_id": 3, "n": 7}, session=session)
        assert await db.c.find({}, session=session).sort("_id").to_list() == [
            {"_id": 1, "n": 0},
            {"_id": 3, "n": 7},
        ]
        assert await db.c.count_documents({}) == 2  # nobody else sees 3 yet
        await session.commit_transaction()
    assert await db.c.find().sort("_id").to_list() == [
        {"_id": 1, "n": 5},
        {"_id": 2, "n": 0},
        {"_id": 3, "n": 7},
    ]


async def test_an_aborted_transaction_leaves_nothing_and_undoes_nobody_elses_writes(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.c.insert_one({"_id": 1, "n": 0})
    async with client.start_session() as session:
        await session.start_transaction()
        await db.c.insert_one({"_id": 2}, session=session)
        await db.c.delete_one({"_id": 1}, session=session)
        await db.c.insert_one({"_id": 3})  # plain, while the transaction is open
        await session.abort_transaction()
    assert await db.c.find().sort("_id").to_list() == [{"_id": 1, "n": 0}, {"_id": 3}]


async def test_a_unique_key_held_by_an_open_transaction_conflicts_then_is_a_duplicate(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.inbox.create_index("key", unique=True)
    first, second = client.start_session(), client.start_session()
    await first.start_transaction()
    await second.start_transaction()
    await db.inbox.insert_one({"_id": 1, "key": "m-1"}, session=first)
    with pytest.raises(OperationFailure) as raised:
        await db.inbox.insert_one({"_id": 2, "key": "m-1"}, session=second)
    assert raised.value.code == WRITE_CONFLICT and is_transient(raised.value)
    await second.abort_transaction()
    await first.commit_transaction()
    with pytest.raises(DuplicateKeyError):
        await db.inbox.insert_one({"_id": 3, "key": "m-1"})
    for session in (first, second):
        await session.end_session()
    assert await db.inbox.find().to_list() == [{"_id": 1, "key": "m-1"}]


async def test_a_compound_unique_key_is_one_per_bson_value_in_and_out_of_transactions(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    # The outbox's aggregate_sequence index; the emulator checks it by key (_unique_keys.py).
    keys = [("aggregate_id", 1), ("aggregate_type", 1), ("sequence", 1)]
    numbered = {"sequence": {"$type": "number"}}
    await db.entries.create_index(keys, unique=True, partialFilterExpression=numbered)
    entry = {"aggregate_type": "orders", "aggregate_id": 7}
    await db.entries.insert_many([{"_id": 1, **entry, "sequence": 1}, {"_id": 2, **entry}])
    await db.entries.insert_one({"_id": 3, **entry})  # left out of the index: no sequence
    for sequence in (1, 1.0, Int64(1)):  # equal numbers are one key
        with pytest.raises(DuplicateKeyError):
            await db.entries.insert_one({"_id": 4, **entry, "sequence": sequence})
    async with client.start_session() as session:
        await session.start_transaction()
        with pytest.raises(DuplicateKeyError):
            await db.entries.insert_one({"_id": 4, **entry, "sequence": 1}, session=session)
    await db.entries.insert_one({"_id": 4, **entry, "sequence": 2})
    with pytest.raises(DuplicateKeyError):  # an update onto a stored key
        await db.entries.update_one({"_id": 4}, {"$set": {"sequence": 1}})
    await db.entries.update_one({"_id": 4}, {"$set": {"sequence": 3}})  # onto its own: fine
    # An array makes the index multikey: each element is a key of its own.
    await db.entries.insert_one({"_id": 5, **entry, "aggregate_id": [8, 9], "sequence": 1})
    with pytest.raises(DuplicateKeyError):
        await db.entries.insert_one({"_id": 6, **entry, "aggregate_id": 9, "sequence": 1})
    assert await db.entries.count_documents({}) == 5


async def test_with_transaction_retries_conflicts_so_no_increment_is_lost(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.c.insert_one({"_id": 1, "n": 0})

    async def read_then_write(session: Any) -> None:
        found = await db.c.find_one({"_id": 1}, session=session)
        await asyncio.sleep(0)  # let the others read the same value
        await db.c.update_one({"_id": 1}, {"$set": {"n": found["n"] + 1}}, session=session)

    async def worker() -> None:
        async with client.start_session() as session:
            for _ in range(10):
                await session.with_transaction(read_then_write)

    await asyncio.gather(*(worker() for _ in range(4)))
    assert await db.c.find_one({"_id": 1}) == {"_id": 1, "n": 40}


async def test_a_change_stream_sees_each_commit_once_in_commit_order(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    async with await db.c.watch() as stream:
        sessions = [client.start_session() for _ in range(3)]
        for number, session in enumerate(sessions):
            await session.start_transaction()
            await db.c.insert_one({"_id": f"{number}-x"}, session=session)
            await db.c.insert_one({"_id": f"{number}-y"}, session=session)
        aborted = client.start_session()
        await aborted.start_transaction()
        await db.c.insert_one({"_id": "aborted"}, session=aborted)
        await aborted.abort_transaction()
        for number in (2, 0, 1):
            await sessions[number].commit_transaction()
        seen = []
        while len(seen) < 6:
            change = await stream.try_next()
            if change is not None:
                seen.append(change["documentKey"]["_id"])
        assert seen == ["2-x", "2-y", "0-x", "0-y", "1-x", "1-y"]
        assert await stream.try_next() is None
    for session in [*sessions, aborted]:
        await session.end_session()


# The model check: many sessions run random transactions (read-modify-write of counters, inserts,
# aborts) beside plain increments and inserts, each retried on TransientTransactionError. The
# final state must equal a serial replay of what succeeded: every counter equals the number of
# increments that committed, and exactly the committed inserts exist. A lost update, a write of
# an aborted transaction, or a commit that undid another's write changes one of these.

SCHEDULES = 1_000
# The schedules run as ten tests of a hundred: one test of a thousand took 54 s on a quiet
# machine and outran the suite's two-minute hang guard on a loaded one.
SHARDS = 10
COUNTERS = 3


async def _one_schedule(db: Any, client: AsyncMongoClient[Any], seed: int) -> None:
    rng = random.Random(seed)
    collection = db[f"m{seed}"]
    await collection.insert_many([{"_id": f"c{i}", "n": 0} for i in range(COUNTERS)])
    expected = [0] * COUNTERS
    inserted: set[str] = set()

    async def actor(name: int) -> None:
        for step in range(2):
            if rng.random() < 0.3:  # a plain write, outside any transaction
                counter = rng.randrange(COUNTERS)
                await collection.update_one({"_id": f"c{counter}"}, {"$inc": {"n": 1}})
                expected[counter] += 1
                continue
            plan = [rng.randrange(-1, COUNTERS) for _ in range(rng.randint(1, 3))]
            abort = rng.random() < 0.15
            async with client.start_session() as session:
                while True:
                    effects: list[int] = []
                    await session.start_transaction()
                    try:
                        for index, counter in enumerate(plan):
                            if counter < 0:
                                await collection.insert_one(
                                    {"_id": f"{name}-{step}-{index}"}, session=session
                                )
                                continue
                            found = await collection.find_one(
                                {"_id": f"c{counter}"}, session=session
                            )
                            await asyncio.sleep(0)
                            await collection.update_one(
                                {"_id": f"c{counter}"},
                                {"$set": {"n": found["n"] + 1}},
                                session=session,
                            )
                            effects.append(counter)
                        if abort:
                            await session.abort_transaction()
                            break
                        await session.commit_transaction()
                    except PyMongoError as error:
                        if session.in_transaction:
                            await session.abort_transaction()
                        if is_transient(error):
                            continue
                        raise
                    for counter in effects:
                        expected[counter] += 1
                    inserted.update(
                        f"{name}-{step}-{index}" for index, c in enumerate(plan) if c < 0
                    )
                    break

    await asyncio.gather(*(actor(name) for name in range(rng.randint(2, 4))))
    counters = {
        d["_id"]: d.get("n") for d in await collection.find({"n": {"$exists": True}}).to_list()
    }
    assert counters == {f"c{i}": expected[i] for i in range(COUNTERS)}, f"seed {seed}"
    others = {d["_id"] for d in await collection.find({"n": {"$exists": False}}).to_list()}
    assert others == inserted, f"seed {seed}"
    await collection.drop()


@pytest.mark.model
@pytest.mark.parametrize("shard", range(SHARDS))
async def test_random_schedules_end_as_a_serial_replay_of_what_committed(
    client: AsyncMongoClient[Any], db: Any, shard: int
) -> None:
    for seed in range(shard, SCHEDULES, SHARDS):
        await _one_schedule(db, client, seed)


async def test_a_renamed_collection_keeps_its_conflicts(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.before.insert_one({"_id": 1, "n": 0})
    rename = {"renameCollection": f"{db.name}.before", "to": f"{db.name}.after"}
    try:
        await client.admin.command(rename)  # where a server takes it
    except OperationFailure:
        await db.command(rename)  # where mongoeco does
    async with client.start_session() as session:
        await session.start_transaction()
        assert (await db.after.find_one({"_id": 1}, session=session))["n"] == 0
        await db.after.update_one({"_id": 1}, {"$inc": {"n": 1}})  # plain, after the snapshot
        with pytest.raises(OperationFailure) as raised:
            await db.after.update_one({"_id": 1}, {"$inc": {"n": 10}}, session=session)
        assert raised.value.code == WRITE_CONFLICT and is_transient(raised.value)
        await session.abort_transaction()
    assert await db.after.find_one({"_id": 1}) == {"_id": 1, "n": 1}


@contextlib.asynccontextmanager
async def transaction_lifetime(client: AsyncMongoClient[Any], seconds: int) -> AsyncIterator[None]:
    """The server's transactionLifetimeLimitSeconds lowered for the block, then put back.

    It is server-wide: another client's transaction open longer than ``seconds`` meanwhile is
    aborted too (and retried, if it runs under ``with_transaction``)."""
    name = "transactionLifetimeLimitSeconds"
    before = (await client.admin.command({"getParameter": 1, name: 1}))[name]
    await client.admin.command({"setParameter": 1, name: seconds})
    try:
        yield
    finally:
        await client.admin.command({"setParameter": 1, name: before})


# A server's reaper runs every max(1 s, half the lifetime): a 1 s lifetime ends a transaction
# within 2 s of its start.
SHORT_LIFETIME = 1
PAST_IT = 2.5


async def test_a_commit_after_the_transaction_lifetime_is_refused_and_writes_nothing(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    async with transaction_lifetime(client, SHORT_LIFETIME), client.start_session() as session:
        await session.start_transaction()
        await db.c.insert_one({"_id": "late"}, session=session)
        await asyncio.sleep(PAST_IT)
        with pytest.raises(OperationFailure) as refused:
            await session.commit_transaction()
    assert refused.value.code == NO_SUCH_TRANSACTION and is_transient(refused.value)
    assert await db.c.count_documents({}) == 0


async def test_with_transaction_past_the_lifetime_runs_the_transaction_again(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    attempts = 0

    async def slow_first_time(session: Any) -> None:
        nonlocal attempts
        attempts += 1
        await db.c.insert_one({"_id": "once", "attempt": attempts}, session=session)
        if attempts == 1:
            await asyncio.sleep(PAST_IT)

    async with transaction_lifetime(client, SHORT_LIFETIME), client.start_session() as session:
        await session.with_transaction(slow_first_time)
    assert attempts == 2
    assert await db.c.find().to_list() == [{"_id": "once", "attempt": 2}]


async def test_the_server_says_it_is_a_replica_set_primary(client: AsyncMongoClient[Any]) -> None:
    """What a driver reads to run retryable writes, commit retries and the read-preference rules
    of transactions; the emulator says it as a single-node replica set does."""
    hello = await client.admin.command("hello")
    assert hello["isWritablePrimary"] is True
    assert hello["setName"]
    assert hello["primary"] == hello["me"] and hello["me"] in hello["hosts"]
    assert hello["logicalSessionTimeoutMinutes"] > 0
    (server,) = client.topology_description.server_descriptions().values()
    assert server.server_type_name == "RSPrimary"
    assert server.retryable_writes_supported


@pytest.mark.parametrize("held", [0, 2, 3])
async def test_plain_writes_that_waited_on_a_transaction_count_every_document_once(
    client: AsyncMongoClient[Any], db: Any, held: int
) -> None:
    """A multi-document write that meets a document a transaction holds waits, then goes on:
    its counts are of the whole write, the documents before the wait included (the outbox's
    embedded claim reads ``modified_count``)."""
    await db.c.insert_many([{"_id": n, "n": 0} for n in range(5)])
    await db.d.insert_many([{"_id": n} for n in range(4)])

    async def waiting_on(write: Any, collection: Any) -> Any:
        async with client.start_session() as session:
            await session.start_transaction()
            await collection.update_one({"_id": held}, {"$set": {"by": "txn"}}, session=session)
            plain = asyncio.create_task(write)
            done, _ = await asyncio.wait({plain}, timeout=0.3)
            assert not done, "a plain write went past a transaction holding its document"
            await session.commit_transaction()
        return await plain

    updated = await waiting_on(db.c.update_many({}, {"$set": {"n": 1}}), db.c)
    assert (updated.matched_count, updated.modified_count) == (5, 5)
    assert await db.c.count_documents({"n": 1}) == 5
    deleted = await waiting_on(db.d.delete_many({}), db.d)
    assert deleted.deleted_count == 4
    assert await db.d.count_documents({}) == 0


async def test_a_unique_index_with_a_collation_conflicts_on_keys_its_collation_calls_equal(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    # Strength 2 ignores case: "B" and "b" are one key, plain or in transactions.
    caseless = {"locale": "en", "strength": 2}
    await db.names.create_index("name", unique=True, collation=caseless)
    await db.names.insert_one({"_id": 1, "name": "A"})
    with pytest.raises(DuplicateKeyError):
        await db.names.insert_one({"_id": 2, "name": "a"})
    first, second = client.start_session(), client.start_session()
    await first.start_transaction()
    await second.start_transaction()
    await db.names.insert_one({"_id": 3, "name": "B"}, session=first)
    with pytest.raises(OperationFailure) as raised:
        await db.names.insert_one({"_id": 4, "name": "b"}, session=second)
    assert raised.value.code == WRITE_CONFLICT and is_transient(raised.value)
    await second.abort_transaction()
    await first.commit_transaction()
    with pytest.raises(DuplicateKeyError):
        await db.names.insert_one({"_id": 5, "name": "b"})
    for session in (first, second):
        await session.end_session()
    assert await db.names.find().sort("_id").to_list() == [
        {"_id": 1, "name": "A"},
        {"_id": 3, "name": "B"},
    ]


async def test_a_unique_index_built_beside_an_open_transaction_waits_for_its_commit(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    # The build needs the collection to itself: it starts once the transaction commits, then
    # finds the duplicate that commit made.
    await db.keys.insert_one({"_id": 1, "key": "k"})
    async with client.start_session() as session:
        await session.start_transaction()
        await db.keys.insert_one({"_id": 2, "key": "k"}, session=session)
        build = asyncio.create_task(db.keys.create_index("key", unique=True))
        done, _ = await asyncio.wait({build}, timeout=0.5)
        assert not done, "a unique index was built beside a transaction writing its collection"
        await session.commit_transaction()
    with pytest.raises(DuplicateKeyError):
        await build
    assert await db.keys.count_documents({}) == 2
    assert "key_1" not in await db.keys.index_information()
