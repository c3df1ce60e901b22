"""Pipelined JetStream publishing with an ack mux of its own.

nats-py offers two ways to publish to JetStream, neither fit for a relay's waves. ``js.publish``
is a request per message: a future, a timer and a task each, one round trip awaited per call.
``js.publish_async`` pipelines, but leaves a message's ack future pending for ever when the
stream answers with an error (nats.py#985: its reply callback raises instead of failing the
future), so a refused message costs a whole timeout and hides the broker's reason.

Here a publisher subscribes once to a wildcard under an inbox of its own, sends each message of
a chunk with a reply subject under it (the inbox and a counter), and the reply callback parses
the PubAck JSON and records the message's outcome in its chunk: ``None`` once stored (a
``duplicate`` included: the stream already has it), else the stream's error, at once. The
chunk waits for all its acks under one deadline; no task, future or timer per message.

The header block is encoded once per message (nats-py's ``publish`` would encode it again,
checking every name with a regular expression, which was a third of the cost per message), and
while the connection is up the HPUB command goes straight to the client's write buffer. A chunk
hands its messages to the connection every 64 (``NatsPublisher``), and lets the loop run, so the
server stores the first ones while the rest are built. Those client internals are looked up when
this module is imported; without them (or while reconnecting, when the client's own buffering
rules apply) ``publish`` is used.

Acks come back the same way. The connection's reader hands each message to the client's
``_process_msg``, which a mux's connection has wrapped: a plain ack on a mux's subscription is
settled there, without the ``Msg``, decoding and queueing nats-py would spend on it, and
everything else goes on as before. A status reply (it has headers) goes nats-py's way, to the
subscription's queue, replaced by one that settles each ack as it is put (with another nats-py,
the callback).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
from collections.abc import Callable
from typing import Any

import nats.js.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription

_STATUS = "Status"
_DESCRIPTION = "Description"
_NO_RESPONDERS = "503"  # the server's answer when no stream listens on the subject
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_HEADER_LINE = b"NATS/1.0\r\n"
# A stored message's ack starts so; one naming no "error" needs no JSON parse.
_ACKED = b'{"stream":'


def _buffered_writes() -> bool:
    # nats-py queues each command's bytes in the connection's ``_pending`` list, counted in
    # ``_pending_data_size``, and ``_flush_pending`` hands them to its flusher task.
    if not callable(getattr(Client, "_flush_pending", None)):
        return False  # pragma: no cover - another nats-py
    try:
        client = Client()
    except Exception:  # noqa: BLE001 - another nats-py: its publish is used
        return False
    return isinstance(getattr(client, "_pending", None), list) and isinstance(
        getattr(client, "_pending_data_size", None), int
    )


_RAW = _buffered_writes()


def _queued_subscriptions() -> bool:
    # nats-py hands a subscription's messages to its ``_pending_queue`` (put_nowait), read by
    # a task that calls the callback; ``_Acks`` takes that queue's place.
    try:
        return isinstance(Subscription(None)._pending_queue, asyncio.Queue)
    except Exception:  # noqa: BLE001 - another nats-py: its callback path is taken
        return False


_DIRECT = _queued_subscriptions()


def header_block(headers: dict[str, str]) -> bytes:
    """The header block as the NATS protocol frames it (what ``max_payload`` counts)."""
    text = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    if text.count("\n") != len(headers) or text.count("\r") != len(headers):
        # A line break inside a value would split the block: sent as a space, as nats-py does.
        text = "".join([f"{k}: {v.translate(_NEWLINES)}\r\n" for k, v in headers.items()])
    return _HEADER_LINE + text.encode() + b"\r\n"


def outcome(data: bytes, headers: dict[str, str] | None) -> BaseException | None:
    """What a JetStream reply (its body and headers) says of its message: ``None`` when
    stored, else the error."""
    if data.startswith(_ACKED) and b'"error"' not in data:
        return None
    if headers and not data:
        status = headers.get(_STATUS)
        if status == _NO_RESPONDERS:
            return nats.js.errors.NoStreamResponseError()
        if status is not None:
            return nats.js.errors.APIError(
                code=int(status) if status.isdigit() else None,
                description=headers.get(_DESCRIPTION),
            )
    try:
        reply = json.loads(data)
    except ValueError:
        return nats.js.errors.APIError(description=f"unreadable JetStream ack {data[:80]!r}")
    if not isinstance(reply, dict):
        return nats.js.errors.APIError(description=f"unreadable JetStream ack {data[:80]!r}")
    error = reply.get("error")
    if error is not None:
        try:
            # nats-py raises the error's class (503 ServiceUnavailableError, 400 BadRequestError
            # ...) rather than returning it.
            nats.js.errors.APIError.from_error(error)
        except nats.js.errors.APIError as refused:
            return refused
        except (KeyError, TypeError):
            return nats.js.errors.APIError(description=f"unreadable JetStream error {error!r}")
    if "stream" not in reply:
        return nats.js.errors.APIError(description=f"not a JetStream ack: {data[:80]!r}")
    return None


class Chunk:
    """The outcomes of one chunk's messages, filled in by the reply callback."""

    __slots__ = ("done", "outcomes", "tokens", "waiting")

    def __init__(self, size: int, done: asyncio.Future[None]) -> None:
        self.outcomes: list[BaseException | None] = [None] * size
        self.tokens: list[tuple[int, int]] = []
        # The sender counts as one until it has sent the lot (``sent``): acks that come back
        # while it still sends must not complete the chunk.
        self.waiting = 1
        self.done = done

    def settle(self, index: int, result: BaseException | None) -> None:
        self.outcomes[index] = result
        self._less()

    def sent(self) -> None:
        self._less()

    def _less(self) -> None:
        self.waiting -= 1
        if not self.waiting and not self.done.done():
            self.done.set_result(None)


class AckMux:
    """One wildcard subscription on a connection, matching JetStream acks to their messages by
    reply subject."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = ""
        self._prefix_bytes = b""
        self.closed = False
        self.pending: dict[int, tuple[Chunk, int]] = {}
        self._counter = itertools.count()
        self._starting = asyncio.Lock()
        self._unflushed = False
        self._subscription: Any = None

    async def start(self) -> str:
        """The reply prefix, subscribing at the first call (the connection resubscribes it
        after a reconnect)."""
        if not self.prefix:
            async with self._starting:
                if not self.prefix:
                    inbox = self.nc.new_inbox()
                    self._subscription = await self._subscribe(f"{inbox}.*")
                    self.prefix = f"{inbox}."
                    self._prefix_bytes = self.prefix.encode()
        if self.closed:
            # Closed while it subscribed: ``close`` found no subscription to drop yet.
            await self._drop()
            raise nats.errors.ConnectionClosedError()
        return self.prefix

    async def _subscribe(self, subject: str) -> Any:
        if not _DIRECT:
            return await self.nc.subscribe(subject, cb=self._reply)
        # Without a callback nats-py starts no task; its queue, replaced before any ack can
        # come, settles each ack as the reader hands it over.
        subscription = await self.nc.subscribe(subject)
        subscription._pending_queue = _Acks(self._settle, subscription)
        if _ROUTED:
            _routes(self.nc)[subscription._id] = self
        return subscription

    async def close(self, error: BaseException) -> None:
        """Fail what still awaits its ack with ``error``, and unsubscribe: on a borrowed
        connection the subscription would outlive the publisher."""
        self.closed = True
        self.fail_all(error)
        await self._drop()

    async def _drop(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            routes = getattr(self.nc, _ROUTES, None)
            if routes is not None:
                routes.pop(subscription._id, None)
            if not self.nc.is_closed:
                await subscription.unsubscribe()

    def expect(self, chunk: Chunk, index: int) -> str:
        """Register a message of ``chunk``; returns the reply subject to send it with."""
        token = next(self._counter)
        self.pending[token] = (chunk, index)
        chunk.tokens.append((token, index))
        chunk.waiting += 1
        return f"{self.prefix}{token}"

    def writable(self) -> bool:
        """Whether ``write`` may put messages in the connection's buffer: while it is up (it
        cannot change before the caller yields)."""
        nc = self.nc
        return _RAW and nc.is_connected and not nc.is_draining_pubs

    def write(self, subject: str, reply: str, body: bytes, block: bytes) -> None:
        """Queue one message in the connection's buffer, as nats-py's ``publish`` does while
        connected (``flush`` hands the lot over)."""
        nc: Any = self.nc
        command = b"".join(
            (
                f"HPUB {subject} {reply} {len(block)} {len(block) + len(body)}\r\n".encode(),
                block,
                body,
                b"\r\n",
            )
        )
        nc._pending.append(command)
        nc._pending_data_size += len(command)
        stats = nc.stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += len(body)
        self._unflushed = True

    async def send(self, subject: str, reply: str, body: bytes, headers: dict[str, str]) -> None:
        """Publish one message through nats-py, whose rules apply while it is not connected."""
        await self.nc.publish(subject, body, reply=reply, headers=headers)

    async def flush(self) -> None:
        if self._unflushed:
            self._unflushed = False
            queue = getattr(self.nc, "_flush_queue", None)
            # A kick already queued writes the whole buffer when the flusher takes it (as
            # nats-py's publish reasons); each one more would fill its bounded queue while a
            # server that stopped reading holds the flusher.
            if queue is None or queue.empty():
                await self.nc._flush_pending()

    def unsend(self, chunk: Chunk) -> None:
        """The message ``expect`` registered last could not be sent: no ack will come."""
        token, _ = chunk.tokens.pop()
        self.pending.pop(token, None)
        chunk.waiting -= 1

    def fail_all(self, error: BaseException) -> None:
        """Give every message still awaiting its ack ``error`` (the publisher is closing)."""
        pending, self.pending = self.pending, {}
        for chunk, index in pending.values():
            chunk.settle(index, error)

    def abandon(self, chunk: Chunk) -> list[int]:
        """Stop waiting for what ``chunk`` still awaits; returns those messages' indexes."""
        left = []
        for token, index in chunk.tokens:
            if self.pending.pop(token, None) is not None:
                left.append(index)
        return left

    async def _reply(self, msg: Any) -> None:
        self._settle(msg)

    def _settle(self, msg: Any) -> None:
        subject: str = msg.subject
        self.answered(subject.encode(errors="replace"), msg.data, msg.headers)

    def answered(self, subject: bytes, data: bytes, headers: dict[str, str] | None) -> None:
        """Settle the message whose reply subject is ``subject`` with what its ack says."""
        token = subject[len(self._prefix_bytes) :]
        if not (subject.startswith(self._prefix_bytes) and token.isdigit() and self.prefix):
            return  # not one of ours: nothing awaits it
        # A late ack (its chunk timed out or was cancelled) finds nothing and is dropped.
        waiter = self.pending.pop(int(token), None)
        if waiter is not None:
            chunk, index = waiter
            try:
                result = outcome(data, headers)
            except Exception as error:  # noqa: BLE001 - raised into the connection's reader
                result = nats.js.errors.APIError(description=f"unreadable JetStream ack: {error}")
            chunk.settle(index, result)


_ROUTES = "_mongo_outbox_ack_routes"


def _routes(nc: Client) -> dict[int, AckMux]:
    """The ack muxes of ``nc`` by subscription id. The connection's ``_process_msg`` (a method
    of its own, set at the first call) hands a mux's plain acks straight to it, and everything
    else on as before: nats-py would build a ``Msg`` for each, decode its subject and reply,
    parse its absent headers and queue it (half of an ack's cost). A status reply (a 503, with
    headers) takes nats-py's way. The mux's subscription counts no received messages then, as
    it sets no limit on them."""
    routes: dict[int, AckMux] | None = getattr(nc, _ROUTES, None)
    if routes is None:
        routes = {}
        process: Any = nc._process_msg  # typed by nats-py as taking headers as bytes alone

        async def process_msg(
            sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
        ) -> None:
            mux = routes.get(sid)
            if mux is None or headers:
                await process(sid, subject, reply, data, headers)
                return
            stats: Any = nc.stats
            stats["in_msgs"] += 1
            stats["in_bytes"] += len(data)
            mux.answered(subject, data, None)

        setattr(nc, "_process_msg", process_msg)  # noqa: B010 - an instance's own method
        setattr(nc, _ROUTES, routes)
    return routes


def _parsed_messages() -> bool:
    # nats-py's parser hands each MSG to the connection's ``_process_msg`` so, subject and body
    # as bytes, headers as bytes or None.
    try:
        names = list(inspect.signature(Client._process_msg).parameters)
    except (AttributeError, TypeError, ValueError):  # pragma: no cover - another nats-py
        return False
    return names == ["self", "sid", "subject", "reply", "data", "headers"]


class _Acks(asyncio.Queue[Any]):
    """A subscription's message queue that queues nothing: each message goes to ``settle`` as
    the connection's reader puts it, with no task between them (a queue, a task switch and a
    callback per ack cost as much as the ack's own handling)."""

    def __init__(self, settle: Callable[[Any], None], subscription: Any) -> None:
        super().__init__()
        self._settle_ack = settle
        self._subscription = subscription

    def put_nowait(self, item: Any) -> None:
        # nats-py counted the message as pending (its slow-consumer limit): it is handled.
        self._subscription._pending_size -= len(item.data)
        self._settle_ack(item)


async def wait_all(chunk: Chunk, timeout: float) -> bool:
    """Once every message of ``chunk`` is sent: wait for their acks, at most ``timeout``
    seconds; whether all came."""
    chunk.sent()
    if chunk.waiting:
        await asyncio.wait((chunk.done,), timeout=timeout)
    return not chunk.waiting


_ROUTED = _DIRECT and _parsed_messages()
