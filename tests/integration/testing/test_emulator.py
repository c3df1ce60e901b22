"""``mongo_outbox.testing``, the emulator users run their own tests on: it starts, serves a real
client (change streams included), stops, and says plainly why when it cannot run.

These start emulators of their own, whichever MongoDB the rest of the session uses; without an
interpreter that can run one (Python >= 3.13 with mongoeco, or ``MONGOECO_PYTHON``) the tests
that need one skip."""

from __future__ import annotations

import importlib.util
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient

import mongo_outbox.testing
from mongo_outbox import ConfigurationError, Event, Outbox
from mongo_outbox.testing import start_emulator

CAN_RUN = bool(os.environ.get("MONGOECO_PYTHON")) or (
    sys.version_info >= (3, 13) and importlib.util.find_spec("mongoeco") is not None
)
needs_emulator = pytest.mark.skipif(
    not CAN_RUN, reason="needs Python >= 3.13 with mongoeco, or MONGOECO_PYTHON"
)


def refuses_connections(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_the_public_surface_is_start_emulator_start_nats_and_their_results() -> None:
    assert set(mongo_outbox.testing.__all__) == {
        "Emulator",
        "NatsServer",
        "start_emulator",
        "start_nats",
    }


def test_importing_the_library_and_its_testing_package_does_not_import_mongoeco() -> None:
    code = (
        "import sys, mongo_outbox, mongo_outbox.testing, mongo_outbox.testing.emulator; "
        "sys.exit('mongoeco' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@needs_emulator
async def test_a_client_saves_and_watches_and_the_emulator_stops_with_its_block() -> None:
    with start_emulator() as mongo:
        client: AsyncMongoClient[Any] = AsyncMongoClient(mongo.uri, tz_aware=True)
        try:
            outbox = Outbox(client.shop)
            async with await client.shop.outbox.watch() as stream:
                async with client.start_session() as session:
                    await outbox.save_with_events(
                        session, client.shop.orders, {"_id": "o-1"}, [Event(type="placed")]
                    )
                change = await stream.next()
            assert change["operationType"] == "insert"
            assert change["fullDocument"]["type"] == "placed"
        finally:
            await client.close()
    assert mongo.process.returncode is not None
    assert refuses_connections(mongo.port)
    mongo.stop()  # a second stop is harmless


@needs_emulator
def test_the_emulator_does_not_outlive_a_parent_that_was_killed() -> None:
    code = (
        "import os; from mongo_outbox.testing import start_emulator; "
        "print(start_emulator().port, flush=True); os._exit(0)"  # no stop(), as under SIGKILL
    )
    parent = subprocess.run(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=30
    )
    port = int(parent.stdout)
    deadline = time.monotonic() + 10
    while not refuses_connections(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refuses_connections(port)


def hide_mongoeco(tmp_path: Path) -> str:
    """An interpreter like this one, but where ``import mongoeco`` fails, as if not installed."""
    (tmp_path / "mongoeco").mkdir()
    (tmp_path / "mongoeco" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'mongoeco' (hidden for this test)\")\n"
    )
    python = os.environ.get("MONGOECO_PYTHON") or sys.executable
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path}" exec "{python}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_an_interpreter_without_mongoeco_is_refused_with_the_install_command(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        start_emulator(python=hide_mongoeco(tmp_path))
    assert caught.value.setting == "start_emulator.python"
    assert "mongo-outbox[testing]" in str(caught.value)


def test_an_interpreter_that_does_not_exist_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="/no/such/python") as caught:
        start_emulator(python="/no/such/python")
    assert caught.value.setting == "start_emulator.python"


def test_an_interpreter_without_mongo_outbox_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\necho 'No module named mongo_outbox' >&2\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(ConfigurationError, match=r"mongo-outbox\[testing\]") as caught:
        start_emulator(python=str(script))
    assert caught.value.setting == "start_emulator.python"


def test_an_emulator_silent_past_its_startup_timeout_is_killed_and_reported(
    tmp_path: Path,
) -> None:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nexec sleep 60\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(ConfigurationError, match=r"did not answer within 0\.5 s") as caught:
        start_emulator(python=str(script), startup_timeout=0.5)
    assert caught.value.setting == "start_emulator.startup_timeout"


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_startup_timeout_out_of_range_is_refused_before_anything_starts(
    timeout: float,
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        start_emulator(python="/no/such/python", startup_timeout=timeout)
    assert caught.value.setting == "start_emulator.startup_timeout"


@needs_emulator
def test_a_transaction_past_its_lifetime_is_aborted_and_none_of_its_writes_lands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As a server after transactionLifetimeLimitSeconds: the expired transaction's document
    is free for others at once, and its later commands never run outside it."""
    from pymongo import MongoClient
    from pymongo.errors import OperationFailure

    monkeypatch.setenv("MONGOECO_TRANSACTION_LIFETIME", "1")
    with start_emulator() as mongo:
        client: MongoClient[Any] = MongoClient(mongo.uri)
        try:
            orders = client.shop.orders
            orders.insert_one({"_id": 1, "n": 0})
            session = client.start_session()
            session.start_transaction()
            orders.insert_one({"_id": "a"}, session=session)
            orders.update_one({"_id": 1}, {"$inc": {"n": 1}}, session=session)
            time.sleep(1.5)  # past the lifetime: the next command reaps it
            # Its own command comes first: refused, not run outside it.
            with pytest.raises(OperationFailure) as refused:
                orders.insert_one({"_id": "b"}, session=session)
            assert refused.value.code == 251  # NoSuchTransaction, as a server answers
            assert refused.value.has_error_label("TransientTransactionError")
            orders.update_one({"_id": 1}, {"$inc": {"n": 10}})  # does not wait for it
            with pytest.raises(OperationFailure) as commit:
                session.commit_transaction()
            assert commit.value.code == 251  # NoSuchTransaction
            session.end_session()
            assert list(orders.find().sort("_id", 1)) == [{"_id": 1, "n": 10}]
        finally:
            client.close()


def test_build_info_answers_under_both_of_its_names_as_a_server_does(
    sync_client: MongoClient[Any], mongo: Any
) -> None:
    """PyMongo's server_info() sends ``buildinfo``: django-mongodb-backend checks the server's
    version (7.0 or later) through it."""
    if mongo.kind != "emulator":
        pytest.skip("a real server answers both names anyway")
    info = sync_client.server_info()
    assert info["versionArray"] == sync_client.admin.command("buildInfo")["versionArray"]
    assert tuple(info["versionArray"][:2]) >= (7, 0)
