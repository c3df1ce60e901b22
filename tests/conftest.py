from __future__ import annotations

import ast
import functools
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from pymongo import AsyncMongoClient, MongoClient

from tests.conformance import report as conformance_report
from tests.support.brokers import HAVE_NATS_SERVER, Broker
from tests.support.servers import NATS_URL, RABBITMQ_URL, MongoServer, start_mongo

MONGO: MongoServer | None = None

# No property test has a deadline: one example stalled past Hypothesis's 200 ms by a loaded
# machine (the CI shares its cores with stress-ng) is no defect, and failed a random run. Set
# here so that a new property test has none without anyone remembering it; built on the
# profile already loaded, so Hypothesis's own `ci` profile keeps its other settings.
settings.register_profile("mongo-outbox", settings.default, deadline=None)
settings.load_profile("mongo-outbox")

TESTS = Path(__file__).parent

# The tiers of the pyramid (pyproject.toml declares the markers; docs/testing.md says what each
# tier costs). `unit`, `broker` and `crash` are given here, by rules a reader can check, so that
# a new test lands in its tier without anyone remembering to mark it; `model` is written on the
# state machines and random schedules themselves.
#
# - `unit`: every test under tests/unit (no MongoDB, no broker, no subprocess of ours).
# - `broker`: a test that asks for a fixture connecting to a real broker (directly or through
#   another fixture), or that names a real broker's URL or what starts a broker of its own
#   (BROKER_NAMES): in its own code (decorators included) or in the module's functions,
#   classes, constants and fixtures it names, followed through.
# - `crash`: a test that runs one of tests/crash/'s processes and SIGKILLs it: every test of a
#   module named test_*_crash.py, and the few elsewhere that carry `@pytest.mark.crash`
#   themselves. A module that names tests.crash but neither is a crash module nor marks one of
#   its tests fails the collection, so a new crash test cannot slip into the fast tier.
BROKER_FIXTURES = frozenset(
    {
        # tests/conftest.py: the shared RabbitMQ and NATS, and a nats-server of the test's own.
        "nats_client",
        "nats_stream",
        "amqp_connection",
        "channel",
        "broker",
        # Module fixtures: the shared Redis, and servers of the test's own.
        "redis",
        "redis_server",
        "private_redis",
        "private_nats",
    }
)
# A real broker's URL, or what starts a broker of the test's own or stands in front of the real one.
BROKER_NAMES = frozenset(
    {
        "NATS_URL",
        "RABBITMQ_URL",
        "REDIS_URL",
        "Broker",
        "Gate",
        "FaultyGate",
        "RedisServer",
        "start_nats",
    }
)

# - `testground`: a test of the test MongoDB itself, through plain PyMongo and no library code:
#   every test under TESTGROUND (MongoDB's spec tests; the emulator's transactions, its fail
#   points and its change events checked as MongoDB documents them).
TESTGROUND = (TESTS / "conformance", TESTS / "integration" / "testground")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    checked: set[Path] = set()
    for item in items:
        path = Path(item.path)
        module = getattr(item, "module", None)
        if path.is_relative_to(TESTS / "unit"):
            item.add_marker(pytest.mark.unit)
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & BROKER_FIXTURES or _names_a_broker_url(item, path, fixtures):
            item.add_marker(pytest.mark.broker)
        if any(path.is_relative_to(folder) for folder in TESTGROUND):
            item.add_marker(pytest.mark.testground)
        if path.name.endswith("_crash.py"):
            item.add_marker(pytest.mark.crash)
        elif module is not None and path not in checked:
            checked.add(path)
            _check_crash_marks(path, module)
        item.add_marker(pytest.mark.xdist_group(_worker_group(item, path)))


class _GroupsApplied:
    """Refuses a run on workers whose groups did not take: the broker tests would share the
    leg's brokers across workers (pytest 9 ignores how pytest-xdist 3.8 names a group)."""

    @pytest.hookimpl(trylast=True)  # after pytest-xdist named each test's group in its id
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        if getattr(config.option, "loadgroup", False) and any("@" not in i.nodeid for i in items):
            raise pytest.UsageError(
                "pytest-xdist's --dist loadgroup did not group the tests: use pytest < 9 "
                "(pyproject.toml pins it), or WORKERS=0"
            )


def _worker_group(item: pytest.Item, path: Path) -> str:
    """Which tests run one after another on one worker of `pytest -n` (`--dist loadgroup`):
    the broker tests all together, as in a run without workers, since the leg's brokers are
    shared and a test may use a default name (an exchange, a stream) another also uses; every
    other test with the rest of its module. Each worker has its own emulator."""
    if item.get_closest_marker("broker") is not None:
        return "brokers"
    return str(path.relative_to(TESTS))


def _names_a_broker_url(item: pytest.Item, path: Path, fixtures: set[str]) -> bool:
    """Whether the test's code, or what it names of its module, names one of BROKER_NAMES."""
    uses = _url_users(path)
    cls = getattr(item, "cls", None)
    own = cls.__name__ if cls is not None else getattr(item, "originalname", item.name)
    return own in uses or bool(fixtures & uses)


@functools.cache
def _url_users(path: Path) -> frozenset[str]:
    """The module's top-level names whose code names one of BROKER_NAMES, directly or through
    other top-level names of the module."""
    source = path.read_text()
    if not any(name in source for name in BROKER_NAMES):
        return frozenset()
    top: dict[str, set[str]] = {}  # top-level name -> the names its code uses
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            targets = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            assigned = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [t.id for t in assigned if isinstance(t, ast.Name)]
        else:
            continue
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        for target in targets:
            top.setdefault(target, set()).update(used)
    users = {name for name, used in top.items() if used & BROKER_NAMES}
    grew = True
    while grew:  # through helpers that call helpers
        more = {name for name, used in top.items() if name not in users and used & users}
        users |= more
        grew = bool(more)
    return frozenset(users)


def _check_crash_marks(path: Path, module: Any) -> None:
    """Refuses a module that runs tests/crash/ processes but marks none of its tests `crash`."""
    if "tests.crash." not in path.read_text():
        return
    marked = any(
        mark.name == "crash"
        for value in vars(module).values()
        for mark in getattr(value, "pytestmark", ())
    )
    if not marked:
        raise pytest.UsageError(
            f"{path.relative_to(TESTS)} runs tests/crash/ processes but marks no test `crash`: "
            "mark the tests that SIGKILL them, or name the module test_*_crash.py"
        )


def _controller(config: pytest.Config) -> bool:
    """Whether this process hands the tests to workers (`pytest -n N`) rather than runs them."""
    return not hasattr(config, "workerinput") and bool(config.getoption("numprocesses", None))


def pytest_configure(config: pytest.Config) -> None:
    global MONGO
    # The conformance report is summed up where the run's reports all arrive: in the
    # controller of a run with workers, which never collects tests/conformance itself.
    config.pluginmanager.register(conformance_report, "conformance_report")
    config.pluginmanager.register(_GroupsApplied(), "groups_applied")
    if sys.version_info < (3, 11):
        # Seen only on 3.10, in the RabbitMQ outage tests (a gate refuses, hangs or drops the
        # connection): aiormq leaves the transport of a connection attempt that failed or was
        # cancelled mid-handshake (client_call cancels it in a task of its own on 3.10) to the
        # garbage collector, which warns in whichever later test it runs. Not traced further
        # (docs/testing.md). Only that warning, only there; any other still fails.
        for line in (
            "ignore:unclosed transport <_SelectorSocketTransport:ResourceWarning",
            "ignore:Exception ignored in. <function _SelectorTransport.__del__"
            ":pytest.PytestUnraisableExceptionWarning",
        ):
            config.addinivalue_line("filterwarnings", line)
    if not _controller(config):
        MONGO = start_mongo()


def pytest_unconfigure(config: pytest.Config) -> None:
    if MONGO is not None:
        MONGO.stop()


def pytest_report_header(config: pytest.Config) -> list[str]:
    mongodb = MONGO.description if MONGO is not None else "one per worker"
    return [f"mongodb: {mongodb}", f"rabbitmq: {RABBITMQ_URL}  nats: {NATS_URL}"]


@pytest.fixture(scope="session")
def mongo() -> MongoServer:
    assert MONGO is not None
    return MONGO


@pytest.fixture(scope="session")
async def client(mongo: MongoServer) -> AsyncIterator[AsyncMongoClient[Any]]:
    client: AsyncMongoClient[Any] = AsyncMongoClient(mongo.uri, tz_aware=True)
    yield client
    await client.close()


@pytest.fixture(scope="session")
def sync_client(mongo: MongoServer) -> Iterator[MongoClient[Any]]:
    """A PyMongo sync client of the same server, for mongo_outbox.sync."""
    client: MongoClient[Any] = MongoClient(mongo.uri, tz_aware=True)
    yield client
    client.close()


@pytest.fixture
async def db(client: AsyncMongoClient[Any]) -> AsyncIterator[Any]:
    """A database of this test's own, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield client[name]
    await client.drop_database(name)


@pytest.fixture
def unique() -> str:
    """A name no other test uses: for exchanges, queues, streams and subjects."""
    return f"t{uuid.uuid4().hex[:12]}"


# Seconds a test stream remembers a message id (nats_stream).
STREAM_MEMORY = 900.0


@pytest.fixture
async def nats_client() -> AsyncIterator[Any]:
    """A NATS connection to the real server; streams a test creates are its own to delete."""
    import nats

    nc = await nats.connect(NATS_URL, connect_timeout=5, max_reconnect_attempts=1)
    yield nc
    await nc.close()


@pytest.fixture
async def nats_stream(nats_client: Any, unique: str) -> AsyncIterator[str]:
    """A JetStream stream named ``unique`` capturing subjects ``unique.>``; deleted afterwards.

    Its duplicate window outlasts any test (the longest may run 600 s): JetStream's default of
    two minutes let a crash test's republish, legitimately minutes after the first publish on a
    loaded machine, count as a second message where the test counts each event once."""
    js = nats_client.jetstream()
    await js.add_stream(name=unique, subjects=[f"{unique}.>"], duplicate_window=STREAM_MEMORY)
    yield unique
    await js.delete_stream(unique)


@pytest.fixture
async def amqp_connection() -> AsyncIterator[Any]:
    """An aio-pika connection to the real RabbitMQ."""
    import aio_pika

    connection = await aio_pika.connect_robust(RABBITMQ_URL, timeout=5)
    yield connection
    await connection.close()


@pytest.fixture
async def channel(amqp_connection: Any, unique: str) -> AsyncIterator[Any]:
    """A channel for the test's own queues; the exchange named ``unique`` is deleted after."""
    channel = await amqp_connection.channel()
    yield channel
    await channel.exchange_delete(unique)
    await channel.close()


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    """A nats-server with JetStream of the test's own, to kill and restart."""
    if not HAVE_NATS_SERVER:
        pytest.skip("needs the nats-server binary to run a broker of the test's own")
    broker = Broker(tmp_path)
    await broker.start()
    yield broker
    if broker.process and broker.process.returncode is None:
        await broker.kill()
