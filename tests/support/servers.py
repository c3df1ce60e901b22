"""Which MongoDB, RabbitMQ and NATS the tests run against, decided once per session.

MongoDB, most faithful first: ``MONGODB_URI`` (a real replica set); a single-node replica set in
Docker through testcontainers, when a Docker engine answers; else the mongoeco wire-protocol
emulator in a subprocess (real transactions, unique and TTL indexes; change streams through the
shim in ``tests/support/mongo_emulator.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")


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
    if _docker_answers():
        return _start_container()
    return start_emulator()


def start_emulator() -> MongoServer:
    # The emulator needs Python >= 3.13; the library and its tests run on 3.10+, so the
    # emulator may come from another interpreter (MONGOECO_PYTHON) than the tests.
    python = os.environ.get("MONGOECO_PYTHON", sys.executable)
    script = os.path.join(os.path.dirname(__file__), "mongo_emulator.py")
    process = subprocess.Popen(
        [python, script, "0"], stdout=subprocess.PIPE, stderr=sys.stderr, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline().split()
    if len(line) != 3 or line[0] != "ready":
        process.kill()
        raise RuntimeError(
            f"the mongoeco emulator did not start with {python} (it needs Python >= 3.13 and "
            "mongoeco[wire]; set MONGOECO_PYTHON, MONGODB_URI or run a Docker engine)"
        )

    def stop() -> None:
        process.kill()
        process.wait()
        process.stdout.close()

    return MongoServer(
        f"mongodb://127.0.0.1:{line[1]}/?directConnection=true",
        "emulator",
        f"mongoeco {line[2]} wire emulator on port {line[1]} (change streams through a test shim)",
        [stop],
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
