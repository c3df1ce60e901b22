"""Which MongoDB, RabbitMQ and NATS the tests run against, decided once per session.

MongoDB, most faithful first: ``MONGODB_URI`` (a real replica set); a single-node replica set in
Docker through testcontainers, when a Docker engine answers; else (or with ``MONGODB_EMULATOR=1``)
the mongoeco wire-protocol emulator in a subprocess, through ``mongo_outbox.testing`` (real
transactions, unique and TTL indexes; change streams through its shim).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from mongo_outbox.errors import ConfigurationError
from mongo_outbox.testing import start_emulator

RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


@dataclass
class MongoServer:
    uri: str
    kind: str  # "replica-set" | "emulator"
    description: str
    _stop: list[Any] = field(default_factory=list)

    def stop(self) -> None:
        for stop in self._stop:
            stop()


def start_mongo() -> MongoServer:
    uri = os.environ.get("MONGODB_URI")
    if uri:
        return MongoServer(uri, "replica-set", f"MONGODB_URI ({_redact(uri)})")
    if os.environ.get("MONGODB_EMULATOR") != "1" and _docker_answers():
        return _start_container()
    return _start_emulator()


# The crash tests SIGKILL clients mid-transaction; a server aborts such a transaction after
# transactionLifetimeLimitSeconds. docker-compose.yml's replica set uses the same 10 s.
TRANSACTION_LIFETIME = "10"


def _start_emulator() -> MongoServer:
    os.environ.setdefault("MONGOECO_TRANSACTION_LIFETIME", TRANSACTION_LIFETIME)
    try:
        emulator = start_emulator()  # its interpreter: MONGOECO_PYTHON, else this one
    except ConfigurationError as error:
        raise RuntimeError(f"{error} (or set MONGODB_URI, or run a Docker engine)") from error
    _served_first(emulator.process.pid)
    return MongoServer(
        emulator.uri,
        "emulator",
        f"{emulator.description} (change streams through its shim)",
        [emulator.stop],
    )


# A database server runs on a machine of its own, or at least is not starved by its clients: here
# the emulator shares two cores with the suite's workers, its relay subprocesses and (in CI) the
# other leg, and one process serves every command in turn. Starved (stress-ng beside the suite,
# load 8 and more), it answered a relay's lease renewal after its lease was over, and the relay
# rightly stepped down (tests/integration/relay/test_changestream.py's crash test). Slow servers
# are tested on purpose, with fail points (docs/testing.md); not by chance.
EMULATOR_NICENESS = -10


def _served_first(pid: int) -> None:
    """Give the emulator's process the CPU before its clients', where this user may."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, EMULATOR_NICENESS)
    except OSError as error:  # not root
        print(
            f"note: the emulator runs at the suite's own priority ({error}); on a loaded "
            "machine its clients can starve it",
            file=sys.stderr,
        )


def _docker_answers() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_container() -> MongoServer:
    from testcontainers.core.container import DockerContainer

    image = os.environ.get("MONGODB_IMAGE", "mongo:7")
    container = (
        DockerContainer(image).with_command("--replSet rs0 --bind_ip_all").with_exposed_ports(27017)
    )
    container.start()
    initiate = "rs.initiate({_id: 'rs0', members: [{_id: 0, host: 'localhost:27017'}]})"
    deadline = time.monotonic() + 60
    while True:
        code, _ = container.exec(["mongosh", "--quiet", "--eval", initiate])
        status, _ = container.exec(["mongosh", "--quiet", "--eval", "db.hello().isWritablePrimary"])
        if status == 0 and _ == b"true\n":
            break
        if time.monotonic() > deadline:
            container.stop()
            raise RuntimeError(
                f"replica set in {image} did not elect a primary (rs.initiate: {code})"
            )
        time.sleep(0.5)
    port = container.get_exposed_port(27017)
    return MongoServer(
        f"mongodb://127.0.0.1:{port}/?directConnection=true",
        "replica-set",
        f"{image} single-node replica set in Docker (testcontainers)",
        [container.stop],
    )


def _redact(uri: str) -> str:
    if "@" not in uri:
        return uri
    scheme, rest = uri.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
