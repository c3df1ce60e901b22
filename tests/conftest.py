from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient

from tests.support.brokers import HAVE_NATS_SERVER, Broker
from tests.support.servers import NATS_URL, RABBITMQ_URL, MongoServer, start_mongo

MONGO: MongoServer | None = None


def pytest_configure(config: pytest.Config) -> None:
    global MONGO
    MONGO = start_mongo()


def pytest_unconfigure(config: pytest.Config) -> None:
    if MONGO is not None:
        MONGO.stop()


def pytest_report_header(config: pytest.Config) -> list[str]:
    assert MONGO is not None
    return [
        f"mongodb: {MONGO.description}",
        f"rabbitmq: {RABBITMQ_URL}  nats: {NATS_URL}",
    ]


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


@pytest.fixture
async def nats_client() -> AsyncIterator[Any]:
    """A NATS connection to the real server; streams a test creates are its own to delete."""
    import nats

    nc = await nats.connect(NATS_URL, connect_timeout=5, max_reconnect_attempts=1)
    yield nc
    await nc.close()


@pytest.fixture
async def nats_stream(nats_client: Any, unique: str) -> AsyncIterator[str]:
    """A JetStream stream named ``unique`` capturing subjects ``unique.>``; deleted afterwards."""
    js = nats_client.jetstream()
    await js.add_stream(name=unique, subjects=[f"{unique}.>"])
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
