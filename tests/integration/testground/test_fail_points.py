"""MongoDB's ``failCommand`` fail point, checked with plain PyMongo and no mongo-outbox code.

The faults MongoDB's drivers test with (an error code, a closed connection, a slow reply, a
write concern error) come from ``configureFailPoint``; the emulator serves it
(``mongo_outbox/testing/_failpoints.py``) and a replica set started with
``--setParameter enableTestCommands=1`` does (docker-compose.yml). Every test here holds on
both. A fail point is server-wide, so each test narrows it to a client of its own by
``appName``, or to a command nobody else of the suite sends (``buildInfo``), and turns it off
afterwards.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import ConnectionFailure, OperationFailure, WriteConcernError

from tests.support.servers import MongoServer

EXCEEDED_TIME_LIMIT = 262  # retriable, and unlike 91 or 10107 no "not primary" to the driver
WRITE_CONFLICT = 112
NOT_WRITABLE_PRIMARY = 10107
WRITE_CONCERN_FAILED = 64
SELECTION = 5_000  # ms: a closed connection must not cost a 30 s server selection


def configure(mode: Any, **data: Any) -> dict[str, Any]:
    return {"configureFailPoint": "failCommand", "mode": mode, "data": data}


OFF = {"configureFailPoint": "failCommand", "mode": "off"}


@pytest.fixture(scope="module")
def fail_points(mongo: MongoServer) -> None:
    """Skips the module where the server refuses configureFailPoint (a replica set without
    test commands): what it tests does not exist there."""
    with MongoClient(mongo.uri, serverSelectionTimeoutMS=SELECTION) as probe:
        try:
            probe.admin.command(OFF)
        except OperationFailure as error:
            pytest.skip(f"the server refuses configureFailPoint ({error}): enableTestCommands=1")


@pytest.fixture
async def app(fail_points: None, mongo: MongoServer) -> AsyncIterator[AsyncMongoClient[Any]]:
    """A client with an appName of its own; the fail point is off after the test. It retries
    no read or write itself, so what the server answers reaches the test, on a replica set too."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri,
        appName=f"fp-{uuid.uuid4().hex[:8]}",
        serverSelectionTimeoutMS=SELECTION,
        retryWrites=False,
        retryReads=False,
    )
    yield client
    await client.admin.command(OFF)
    await client.close()


def name_of(client: AsyncMongoClient[Any]) -> str:
    name = client.options.pool_options.metadata["application"]["name"]
    assert isinstance(name, str)
    return name


async def entered(client: AsyncMongoClient[Any]) -> int:
    """How many times the fail point was hit so far (it is turned off to ask)."""
    count = (await client.admin.command(OFF))["count"]
    assert isinstance(count, int)
    return count


async def set_fail_point(client: AsyncMongoClient[Any], mode: Any, **data: Any) -> None:
    """The fail point, for ``client``'s commands only (its appName)."""
    await client.admin.command(configure(mode, appName=name_of(client), **data))


# -- each option of the fail point ---------------------------------------------------------


@pytest.mark.parametrize(
    ("in_transaction", "labels", "expected"),
    [
        (False, None, []),
        (True, None, ["TransientTransactionError"]),
        (False, ["RetryableWriteError"], ["RetryableWriteError"]),
        (True, [], []),
    ],
    ids=["server-labels", "server-labels-in-transaction", "given-labels", "no-labels"],
)
async def test_error_code_fails_the_command_unrun_with_that_code_and_labels(
    app: AsyncMongoClient[Any],
    db: Any,
    in_transaction: bool,
    labels: list[str] | None,
    expected: list[str],
) -> None:
    """Without errorLabels, the server's own: a retriable code is transient in a transaction,
    and labelled nothing on a write that is not retryable (no txnNumber)."""
    extra = {} if labels is None else {"errorLabels": labels}
    await set_fail_point(
        app, {"times": 1}, failCommands=["insert"], errorCode=EXCEEDED_TIME_LIMIT, **extra
    )
    async with app.start_session() as session:
        if in_transaction:
            await session.start_transaction()
        with pytest.raises(OperationFailure) as failed:
            await app[db.name].c.insert_one({"_id": 1}, session=session)
        if in_transaction:
            await session.abort_transaction()
    assert failed.value.code == EXCEEDED_TIME_LIMIT
    details = failed.value.details or {}
    assert details.get("codeName") == "ExceededTimeLimit"
    assert sorted(details.get("errorLabels", [])) == expected
    assert await db.c.count_documents({}) == 0  # not run
    await app[db.name].c.insert_one({"_id": 1})  # times: 1 is spent
    assert await db.c.count_documents({}) == 1


async def test_close_connection_hangs_up_without_running_the_command(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    await set_fail_point(app, {"times": 1}, failCommands=["insert"], closeConnection=True)
    with pytest.raises(ConnectionFailure):
        await app[db.name].c.insert_one({"_id": 1})
    assert await db.c.count_documents({}) == 0
    await app[db.name].c.insert_one({"_id": 2})  # on a new connection
    assert await db.c.distinct("_id") == [2]


async def test_block_connection_delays_the_reply_then_runs_the_command(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    await db.c.insert_one({"_id": 1})
    await set_fail_point(
        app, {"times": 1}, failCommands=["find"], blockConnection=True, blockTimeMS=400
    )
    started = time.monotonic()
    assert await app[db.name].c.find_one({"_id": 1}) == {"_id": 1}
    assert time.monotonic() - started >= 0.4
    started = time.monotonic()
    await app[db.name].c.find_one({"_id": 1})
    assert time.monotonic() - started < 0.4  # times: 1 is spent


async def test_block_connection_with_an_error_code_waits_then_fails(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    await set_fail_point(
        app,
        {"times": 1},
        failCommands=["insert"],
        blockConnection=True,
        blockTimeMS=300,
        errorCode=EXCEEDED_TIME_LIMIT,
    )
    started = time.monotonic()
    with pytest.raises(OperationFailure) as failed:
        await app[db.name].c.insert_one({"_id": 1})
    assert time.monotonic() - started >= 0.3
    assert failed.value.code == EXCEEDED_TIME_LIMIT
    assert await db.c.count_documents({}) == 0


async def test_a_write_concern_error_comes_after_the_write_is_applied(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    wce = {"code": WRITE_CONCERN_FAILED, "errmsg": "waiting for replication timed out"}
    await set_fail_point(app, {"times": 1}, failCommands=["insert"], writeConcernError=wce)
    with pytest.raises(WriteConcernError) as failed:
        await app[db.name].c.insert_one({"_id": 1})
    assert failed.value.code == WRITE_CONCERN_FAILED
    assert await db.c.count_documents({}) == 1  # applied all the same


SHUTDOWN_IN_PROGRESS = 91  # retriable: the server labels it RetryableWriteError


@pytest.mark.parametrize("operation", ["insert", "inc", "find_one_and_update"])
async def test_a_retried_write_the_server_applied_is_answered_from_its_record(
    fail_points: None, mongo: MongoServer, db: Any, operation: str
) -> None:
    """The first try is applied and its reply says to retry (a write concern error with a
    retriable code, as a lost reply makes the driver retry): the retry, with the same
    txnNumber, is answered from the server's record of the first, not applied again."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, appName=f"fp-{uuid.uuid4().hex[:8]}", serverSelectionTimeoutMS=SELECTION
    )
    try:
        await db.c.insert_one({"_id": 0, "n": 0})
        wce = {"code": SHUTDOWN_IN_PROGRESS, "errmsg": "shutting down"}
        hits = await entered(client)
        await set_fail_point(
            client, {"times": 1}, failCommands=["insert", "update", "findAndModify"],
            writeConcernError=wce,
        )  # fmt: skip
        mine = client[db.name].c
        if operation == "insert":
            await mine.insert_one({"_id": 1})  # no DuplicateKeyError from its own retry
        elif operation == "inc":
            assert (await mine.update_one({"_id": 0}, {"$inc": {"n": 1}})).modified_count == 1
        else:
            before = await mine.find_one_and_update({"_id": 0}, {"$inc": {"n": 1}})
            assert before == {"_id": 0, "n": 0}  # the first try's answer
        assert await entered(client) == hits + 1  # so the write was retried
        assert await db.c.count_documents({}) == (2 if operation == "insert" else 1)
        assert (await db.c.find_one({"_id": 0}))["n"] == (0 if operation == "insert" else 1)
    finally:
        await client.admin.command(OFF)
        await client.close()


async def test_a_write_whose_reply_was_lost_is_applied_once_though_the_driver_retries_it(
    fail_points: None, mongo: MongoServer, db: Any
) -> None:
    """The reply comes after the client's socket timeout (a network error to the driver): it
    retries at once while the first try still waits, and the server applies the write once."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri,
        appName=f"fp-{uuid.uuid4().hex[:8]}",
        serverSelectionTimeoutMS=SELECTION,
        socketTimeoutMS=200,
    )
    try:
        await db.c.insert_one({"_id": 0, "n": 0})
        await set_fail_point(
            client, {"times": 1}, failCommands=["update"], blockConnection=True, blockTimeMS=500
        )
        await client[db.name].c.update_one({"_id": 0}, {"$inc": {"n": 1}})
        await asyncio.sleep(0.5)  # the first try's block ends: it finds the retry's record
        assert (await db.c.find_one({"_id": 0}))["n"] == 1
    finally:
        await client.admin.command(OFF)
        await client.close()


async def test_a_write_concern_error_alone_leaves_reads_alone_and_they_do_not_count(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    wce = {"code": WRITE_CONCERN_FAILED, "errmsg": "waiting for replication timed out"}
    await set_fail_point(app, {"times": 1}, failCommands=["find", "insert"], writeConcernError=wce)
    assert await app[db.name].c.find_one({}) is None  # a read takes no write concern
    with pytest.raises(WriteConcernError):  # so the one time is still there
        await app[db.name].c.insert_one({"_id": 1})


async def test_fail_commands_names_the_commands_hit_and_others_do_not_count(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    await set_fail_point(app, {"times": 1}, failCommands=["delete"], errorCode=WRITE_CONFLICT)
    await app[db.name].c.insert_one({"_id": 1})
    assert await app[db.name].c.find_one({}) == {"_id": 1}
    with pytest.raises(OperationFailure) as failed:
        await app[db.name].c.delete_one({"_id": 1})
    assert failed.value.code == WRITE_CONFLICT
    await app[db.name].c.delete_one({"_id": 1})
    assert await db.c.count_documents({}) == 0


# -- modes -----------------------------------------------------------------------------------


async def outcomes(client: AsyncMongoClient[Any], count: int) -> list[bool]:
    """Whether each of ``count`` pings was hit (True) or went through."""
    hits = []
    for _ in range(count):
        try:
            await client.admin.command("ping")
        except OperationFailure as error:
            hits.append(error.code)
        else:
            hits.append(None)
    assert set(hits) <= {WRITE_CONFLICT, None}, hits
    return [code is not None for code in hits]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ({"times": 2}, [True, True, False, False, False]),
        ({"skip": 2}, [False, False, True, True, True]),
        ("alwaysOn", [True] * 5),
        ("off", [False] * 5),
        ({"activationProbability": 1}, [True] * 5),
        ({"activationProbability": 0}, [False] * 5),
    ],
    ids=["times", "skip", "alwaysOn", "off", "probability-1", "probability-0"],
)
async def test_the_mode_says_which_matching_commands_are_hit(
    app: AsyncMongoClient[Any], mode: Any, expected: list[bool]
) -> None:
    await set_fail_point(app, mode, failCommands=["ping"], errorCode=WRITE_CONFLICT)
    assert await outcomes(app, 5) == expected


async def test_an_activation_probability_hits_some_commands_and_spares_others(
    app: AsyncMongoClient[Any],
) -> None:
    await set_fail_point(
        app, {"activationProbability": 0.5}, failCommands=["ping"], errorCode=WRITE_CONFLICT
    )
    hits = await outcomes(app, 60)
    assert 5 < sum(hits) < 55  # 1 in 10^10 to fall outside by chance


async def test_configure_answers_how_many_times_the_fail_point_was_hit(
    app: AsyncMongoClient[Any],
) -> None:
    before = await entered(app)
    await set_fail_point(app, {"times": 3}, failCommands=["ping"], errorCode=WRITE_CONFLICT)
    await outcomes(app, 5)
    assert await entered(app) == before + 3


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(["times", "skip"]),
    count=st.integers(min_value=0, max_value=4),
    commands=st.lists(st.sampled_from(["ping", "buildInfo"]), max_size=8),
)
def test_times_and_skip_count_only_the_commands_that_match(
    fail_points: None, mongo: MongoServer, kind: str, count: int, commands: list[str]
) -> None:
    """A model of the counting: ``times: n`` hits the first n pings, ``skip: n`` every ping
    after the first n; a buildInfo in between is neither hit nor counted."""
    app = f"fp-{uuid.uuid4().hex[:8]}"
    with MongoClient(mongo.uri, appName=app, serverSelectionTimeoutMS=SELECTION) as client:
        client.admin.command(
            configure({kind: count}, failCommands=["ping"], errorCode=WRITE_CONFLICT, appName=app)
        )
        try:
            seen = 0
            for command in commands:
                hit = False
                if command == "ping":
                    seen += 1
                    hit = seen <= count if kind == "times" else seen > count
                if hit:
                    with pytest.raises(OperationFailure) as failed:
                        client.admin.command(command)
                    assert failed.value.code == WRITE_CONFLICT
                else:
                    client.admin.command(command)
        finally:
            client.admin.command(OFF)


# -- two clients: the fail point is the server's ---------------------------------------------


async def test_the_fail_point_hits_another_clients_command_too(
    fail_points: None, mongo: MongoServer
) -> None:
    setter: AsyncMongoClient[Any] = AsyncMongoClient(mongo.uri, serverSelectionTimeoutMS=SELECTION)
    other: AsyncMongoClient[Any] = AsyncMongoClient(mongo.uri, serverSelectionTimeoutMS=SELECTION)
    try:
        # buildInfo: nothing else of the suite sends it, so the server-wide point is ours.
        await setter.admin.command(
            configure({"times": 1}, failCommands=["buildInfo"], errorCode=WRITE_CONFLICT)
        )
        with pytest.raises(OperationFailure) as failed:
            await other.admin.command("buildInfo")
        assert failed.value.code == WRITE_CONFLICT
        await setter.admin.command("buildInfo")  # the one time went to the other client
    finally:
        await setter.admin.command(OFF)
        await setter.close()
        await other.close()


async def test_app_name_narrows_the_fail_point_to_that_client(
    app: AsyncMongoClient[Any], mongo: MongoServer
) -> None:
    other: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, appName="fp-other", serverSelectionTimeoutMS=SELECTION
    )
    try:
        await set_fail_point(app, "alwaysOn", failCommands=["ping"], errorCode=WRITE_CONFLICT)
        for _ in range(3):
            await other.admin.command("ping")  # another appName: never hit
        assert await outcomes(app, 2) == [True, True]
    finally:
        await other.close()


# -- transactions ----------------------------------------------------------------------------


async def test_an_error_on_commit_leaves_the_transaction_to_commit_on_retry(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    """The fail point answers before the server looks at the transaction: it is still there."""
    await set_fail_point(
        app,
        {"times": 1},
        failCommands=["commitTransaction"],
        errorCode=WRITE_CONFLICT,
        errorLabels=["TransientTransactionError"],
    )
    async with app.start_session() as session:
        await session.start_transaction()
        await app[db.name].c.insert_one({"_id": 1}, session=session)
        with pytest.raises(OperationFailure) as failed:
            await session.commit_transaction()
        assert failed.value.code == WRITE_CONFLICT
        assert failed.value.has_error_label("TransientTransactionError")
        assert await db.c.count_documents({}) == 0
        await session.commit_transaction()
    assert await db.c.distinct("_id") == [1]


async def test_a_transient_error_on_commit_makes_with_transaction_run_it_again(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    """Without errorLabels, a server labels WriteConflict on a commit itself."""
    await set_fail_point(
        app, {"times": 1}, failCommands=["commitTransaction"], errorCode=WRITE_CONFLICT
    )
    runs = 0

    async def insert(session: Any) -> None:
        nonlocal runs
        runs += 1
        await app[db.name].c.insert_one({"_id": 1}, session=session)

    async with app.start_session() as session:
        await session.with_transaction(insert)
    assert runs == 2
    assert await db.c.distinct("_id") == [1]


async def test_a_closed_connection_at_commit_commits_once_under_with_transaction(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    """The commit's outcome is unknown to the client; it retries the commit, not the
    transaction, and the document is there once."""
    before = await entered(app)
    await set_fail_point(
        app, {"times": 1}, failCommands=["commitTransaction"], closeConnection=True
    )
    runs = 0

    async def insert(session: Any) -> None:
        nonlocal runs
        runs += 1
        await app[db.name].c.insert_one({"_id": 1}, session=session)

    async with app.start_session() as session:
        await session.with_transaction(insert)
    assert runs == 1
    assert await db.c.distinct("_id") == [1]
    assert await entered(app) == before + 1  # the commit was hit


async def test_a_closed_connection_at_commit_is_retried_by_the_driver_itself(
    app: AsyncMongoClient[Any], mongo: MongoServer, db: Any
) -> None:
    """A replica set primary's commit is retryable: the driver sends it again on a new
    connection, and the caller never sees the closed one."""
    before = await entered(app)
    retrying: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, appName=name_of(app), serverSelectionTimeoutMS=SELECTION
    )
    await set_fail_point(
        app, {"times": 1}, failCommands=["commitTransaction"], closeConnection=True
    )
    try:
        async with retrying.start_session() as session:
            await session.start_transaction()
            await retrying[db.name].c.insert_one({"_id": 1}, session=session)
            await session.commit_transaction()
    finally:
        await retrying.close()
    assert await db.c.distinct("_id") == [1]
    assert await entered(app) == before + 1


async def test_an_error_on_abort_is_swallowed_by_the_driver_and_nothing_commits(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    before = await entered(app)
    await set_fail_point(
        app, {"times": 1}, failCommands=["abortTransaction"], errorCode=WRITE_CONFLICT
    )
    async with app.start_session() as session:
        await session.start_transaction()
        await app[db.name].c.insert_one({"_id": 1}, session=session)
        await session.abort_transaction()  # PyMongo ignores an abort's error
    assert await entered(app) == before + 1  # the abort was hit
    assert await db.c.count_documents({}) == 0


# -- change streams --------------------------------------------------------------------------


async def next_change(stream: Any) -> Any:
    for _ in range(50):
        change = await stream.try_next()
        if change is not None:
            return change
    raise AssertionError("no change within 50 polls")


async def test_a_resumable_error_on_get_more_resumes_the_change_stream_losing_nothing(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    collection = app[db.name].c
    before = await entered(app)
    async with await collection.watch(max_await_time_ms=100) as stream:
        await db.c.insert_one({"_id": 1})
        assert (await next_change(stream))["documentKey"] == {"_id": 1}
        await set_fail_point(
            app, {"times": 1}, failCommands=["getMore"], errorCode=NOT_WRITABLE_PRIMARY
        )
        await db.c.insert_one({"_id": 2})
        assert (await next_change(stream))["documentKey"] == {"_id": 2}
    assert await entered(app) == before + 1  # the getMore was hit, and it resumed


async def test_an_error_on_the_change_streams_aggregate_reaches_the_caller(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    await set_fail_point(app, {"times": 1}, failCommands=["aggregate"], errorCode=WRITE_CONFLICT)
    with pytest.raises(OperationFailure) as failed:
        await app[db.name].c.watch()
    assert failed.value.code == WRITE_CONFLICT
    async with await app[db.name].c.watch():  # times: 1 is spent
        pass


async def test_a_closed_connection_on_get_more_resumes_the_change_stream(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    collection = app[db.name].c
    before = await entered(app)
    async with await collection.watch(max_await_time_ms=100) as stream:
        await set_fail_point(app, {"times": 1}, failCommands=["getMore"], closeConnection=True)
        await db.c.insert_one({"_id": 1})
        assert (await next_change(stream))["documentKey"] == {"_id": 1}
    assert await entered(app) == before + 1


HOST_UNREACHABLE = 6  # resumable, and no "not primary" or network error to the driver
AFTER_CHECKOUT = "failGetMoreAfterCursorCheckout"


async def test_a_get_more_failing_after_its_cursor_is_found_is_labelled_resumable_and_resumes(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    collection = app[db.name].c
    off = {"configureFailPoint": AFTER_CHECKOUT, "mode": "off"}
    before = (await app.admin.command(off))["count"]  # hits since the server started
    async with await collection.watch(max_await_time_ms=100) as stream:
        await db.c.insert_one({"_id": 1})
        assert (await next_change(stream))["documentKey"] == {"_id": 1}
        await app.admin.command(
            {
                "configureFailPoint": AFTER_CHECKOUT,
                "mode": {"times": 1},
                "data": {"errorCode": HOST_UNREACHABLE},
            }
        )
        try:
            await db.c.insert_one({"_id": 2})
            assert (await next_change(stream))["documentKey"] == {"_id": 2}
        finally:
            after = (await app.admin.command(off))["count"]
    assert after == before + 1  # hit, and the stream resumed after it


async def test_a_fail_command_error_on_get_more_is_not_labelled_resumable(
    app: AsyncMongoClient[Any], db: Any
) -> None:
    # failCommand hits before the server knows the getMore is a change stream's: no
    # ResumableChangeStreamError, so a driver does not resume after HostUnreachable.
    async with await app[db.name].c.watch(max_await_time_ms=100) as stream:
        await set_fail_point(
            app, {"times": 1}, failCommands=["getMore"], errorCode=HOST_UNREACHABLE
        )
        with pytest.raises(OperationFailure) as failed:
            await next_change(stream)
    assert failed.value.code == HOST_UNREACHABLE
    assert not failed.value.has_error_label("ResumableChangeStreamError")
