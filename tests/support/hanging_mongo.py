"""A FAKE network path to the test MongoDB that can hang one connection: a TCP proxy that, once
told which command to catch, swallows the next request of that command and leaves its
connection open and silent, as a connection hung without a reset is (a stalled NAT or firewall,
a half-open socket). Every other request, and every new connection, goes through. It can also
be cut (every connection reset, new ones refused: MongoDB down) and mended again."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from urllib.parse import urlsplit

import bson

from tests.support.brokers import free_port

_OP_MSG = 2013


def command_of(message: bytes) -> tuple[str, object] | None:
    """The command an OP_MSG request names (its body's first key) and that key's value (the
    collection of a write, the cursor id of a getMore), else None."""
    if len(message) < 21 or struct.unpack_from("<i", message, 12)[0] != _OP_MSG:
        return None
    if message[20] != 0:  # the body section comes first
        return None
    body = bson.decode(message[21 : 21 + struct.unpack_from("<i", message, 21)[0]])
    return next(iter(body.items()), None)


class HangingMongo:
    def __init__(self, uri: str) -> None:
        target = urlsplit(uri)
        self.target = (target.hostname or "127.0.0.1", target.port or 27017)
        self.port = free_port()
        self.uri = f"mongodb://127.0.0.1:{self.port}/?directConnection=true"
        self.catch: str | None = None
        self.catch_on: object = None
        self.catch_holding = b""
        self.hung = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    def hang_next(self, command: str, on: object = None, holding: bytes = b"") -> None:
        """Swallow the next request of ``command`` (on the collection ``on``, and holding the
        bytes ``holding``, e.g. a field name its update sets, if given) and hang its
        connection."""
        self.catch, self.catch_on, self.catch_holding = command, on, holding
        self.hung = asyncio.Event()

    def _caught(self, message: bytes) -> bool:
        command = command_of(message)
        if self.catch is None or command is None or command[0] != self.catch:
            return False
        if self.catch_on is not None and command[1] != self.catch_on:
            return False
        return self.catch_holding in message

    async def __aenter__(self) -> HangingMongo:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()

    async def cut(self) -> None:
        """MongoDB down, as its clients see it: every connection reset, new ones refused."""
        await self.__aexit__()

    async def mend(self) -> None:
        """MongoDB back, on the same port."""
        await self.__aenter__()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream = await asyncio.open_connection(*self.target)
        self.writers |= {writer, upstream}
        silent = asyncio.Event()

        async def requests() -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while not silent.is_set():
                    header = await reader.readexactly(16)
                    message = header + await reader.readexactly(
                        struct.unpack_from("<i", header)[0] - 16
                    )
                    if self._caught(message):
                        self.catch = None
                        silent.set()  # swallowed: no answer ever comes on this connection
                        self.hung.set()
                        break
                    upstream.write(message)
                    await upstream.drain()

        async def replies() -> None:
            with contextlib.suppress(OSError):
                while data := await upstream_reader.read(65536):
                    if silent.is_set():
                        continue
                    writer.write(data)
                    await writer.drain()

        await asyncio.gather(requests(), replies())
        if not silent.is_set():
            writer.transport.abort()
        upstream.transport.abort()
        self.writers -= {writer, upstream}
