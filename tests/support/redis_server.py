"""A redis-server of the test's own, to kill and start again on the same append-only file."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from tests.support.brokers import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
HAVE_REDIS_SERVER = Path(REDIS_SERVER).exists()


class RedisServer:
    """A redis-server on a free port whose every write is fsynced to ``store`` before it
    answers (``appendfsync always``), so that a SIGKILL loses nothing it confirmed."""

    def __init__(self, store: Path) -> None:
        self.port = free_port()
        self.store = store
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            str(self.store),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for _ in range(200):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.write(b"PING\r\n")  # answers +PONG once the append-only file is loaded
            answer = await reader.readline()
            writer.close()
            if answer == b"+PONG\r\n":
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    async def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        await self.process.wait()
