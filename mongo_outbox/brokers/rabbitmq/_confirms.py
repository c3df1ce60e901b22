"""The RabbitMQ publisher's lean path: AMQP frames written a wave at a time, confirms counted by
delivery tag.

aio-pika's ``exchange.publish`` (and aiormq's ``basic_publish`` below it) costs a lock, a write
queue entry, a drain future and a confirmation future per message, and pamqp marshals every
property through its generic encoder: most of the time a publish spends in this process. Here
a wave of messages is encoded by hand into one buffer and put on the connection's write queue
as one entry; the window counts each message's delivery tag, so the broker's acks and nacks
(single ones in any order, ``multiple`` ones covering many, across waves) settle positions in a
list, and one future per wave (created on the channel, so aiormq fails it when the channel or
connection closes) wakes the caller. A returned message (``mandatory``, unroutable) is matched
to the next confirm of a message like it (``ConfirmWindow`` says why that is sound). Nothing is
written while the broker blocks the connection, nor beyond ``UNCONFIRMED_BYTES`` unconfirmed.

The channel is the publisher's own, opened on the connection of the exchange's channel, and
used for nothing else: the tags it counts are all ours. It is an aiormq channel of a class of
its own, whose confirm and return handlers report to the window instead of to a future each.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import weakref
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Coroutine, Sequence
from datetime import datetime
from typing import Any

import aiormq
from pamqp import commands as spec
from pamqp.header import ContentHeader

log = logging.getLogger(__name__)

_FRAME_METHOD = 1
_FRAME_HEADER = 2
_FRAME_BODY = 3
_FRAME_END = b"\xce"
_FRAME_OVERHEAD = 8  # type (1), channel (2), size (4) and the end octet (1)
_BASIC_PUBLISH = struct.pack(">HH", 60, 40)  # Basic (class 60), Publish (method 40)
_MANDATORY = b"\x01"  # Basic.Publish's bits: mandatory set, immediate not
_CONTENT_CLASS = struct.pack(">HH", 60, 0)  # Basic's class id, then the unused weight

# Basic.Properties' flag bits (AMQP 0-9-1, 4.2.6.1), for the properties the publisher sets.
_CONTENT_TYPE = 0x8000
_HEADERS = 0x2000
_DELIVERY_MODE = 0x1000
_PRIORITY = 0x0800
_CORRELATION_ID = 0x0400
_MESSAGE_ID = 0x0080
_TIMESTAMP = 0x0040
_TYPE = 0x0020

_JSON = b"\x10application/json"  # the content type, as a short string
_PERSISTENT_PRIORITY_0 = b"\x02\x00"  # delivery mode 2 (persistent), then priority 0

_frame_head = struct.Struct(">BHI").pack
_long = struct.Struct(">I").pack
_long_long = struct.Struct(">Q").pack
_header_fixed = struct.Struct(">HHQH").pack  # class, weight, body size, property flags

_MEMO_LIMIT = 1_024  # a bound on each memo below: routing keys and header names repeat

PENDING: Any = object()
"""The outcome of a message whose confirm has not arrived."""


def _short(text: str) -> bytes:
    data = text.encode()
    return bytes((len(data),)) + data


class Encoder:
    """Encodes messages as the frames of a ``Basic.Publish`` with its content, as pamqp would
    (the same properties, the headers sorted by name, each a long string), with what repeats
    encoded once: the publish method frame of each routing key and each header's name."""

    def __init__(self, exchange: str) -> None:
        self._exchange = _short(exchange)
        self._methods: dict[tuple[int, str], bytes] = {}
        self._names: dict[str, bytes] = {}

    def method(self, channel: int, key: str) -> bytes:
        frame = self._methods.get((channel, key))
        if frame is None:
            payload = _BASIC_PUBLISH + b"\x00\x00" + self._exchange + _short(key) + _MANDATORY
            frame = _frame_head(_FRAME_METHOD, channel, len(payload)) + payload + _FRAME_END
            if len(self._methods) >= _MEMO_LIMIT:
                self._methods.clear()
            self._methods[(channel, key)] = frame
        return frame

    def table(self, headers: dict[str, str]) -> bytes:
        names = self._names
        parts: list[bytes] = []
        for name in sorted(headers):
            encoded = names.get(name)
            if encoded is None:
                encoded = _short(name) + b"S"
                if len(names) >= _MEMO_LIMIT:
                    names.clear()
                names[name] = encoded
            value = headers[name].encode()
            parts += (encoded, _long(len(value)), value)
        data = b"".join(parts)
        return _long(len(data)) + data

    def content_header(
        self,
        channel: int,
        body_size: int,
        *,
        headers: dict[str, str],
        content_type: str = "application/json",
        message_id: str,
        message_type: str,
        timestamp: datetime,
        correlation_id: str | None,
    ) -> bytes:
        """The content header frame: the properties the publisher sets, in AMQP's order. The
        timestamp is left out for a time before 1970: AMQP's is an unsigned count of seconds
        (pamqp fails on it), and the body carries ``occurred_at`` whole anyway."""
        seconds = timestamp.timestamp()
        flags = _CONTENT_TYPE | _DELIVERY_MODE | _PRIORITY | _MESSAGE_ID
        parts = [b"", _JSON if content_type == "application/json" else _short(content_type)]
        if headers:
            flags |= _HEADERS
            parts.append(self.table(headers))
        parts.append(_PERSISTENT_PRIORITY_0)
        if correlation_id:
            flags |= _CORRELATION_ID
            parts.append(_short(correlation_id))
        parts.append(_short(message_id))
        if seconds >= 0:
            flags |= _TIMESTAMP
            parts.append(_long_long(int(seconds)))
        if message_type:
            flags |= _TYPE
            parts.append(_short(message_type))
        parts[0] = _header_fixed(60, 0, body_size, flags)
        payload = b"".join(parts)
        return _frame_head(_FRAME_HEADER, channel, len(payload)) + payload + _FRAME_END

    @staticmethod
    def body(channel: int, body: bytes, frame_max: int) -> bytes:
        """The body frames: one, unless the body is longer than a frame can carry."""
        room = frame_max - _FRAME_OVERHEAD if frame_max else len(body) or 1
        if len(body) <= room:
            return _frame_head(_FRAME_BODY, channel, len(body)) + body + _FRAME_END
        return b"".join(
            _frame_head(_FRAME_BODY, channel, len(piece)) + piece + _FRAME_END
            for piece in (body[start : start + room] for start in range(0, len(body), room))
        )


ReturnKey = tuple[str, bytes]
"""What a returned message is matched by: its routing key and its body (the event whole, its id
included). A ``basic.return`` carries no delivery tag."""


class Wave:
    """The messages of one ``send``: their outcomes by position, settled by the broker's
    confirms; ``done`` once none is pending (or failed with the channel's error)."""

    __slots__ = ("done", "first", "keys", "low", "pending", "results", "size")

    def __init__(
        self, first: int, keys: list[ReturnKey], size: int, done: asyncio.Future[None]
    ) -> None:
        self.first = first  # the delivery tag of position 0
        self.keys = keys  # each position's routing key and body, to match a return to it
        self.results: list[Any] = [PENDING] * len(keys)
        self.pending = len(keys)
        self.low = 0  # every position below is settled
        self.size = size  # the bytes written
        self.done = done

    def outcome(self, position: int) -> Any:
        """``None`` (acked), a ``Basic.Nack`` frame, a returned message, or ``PENDING``."""
        return self.results[position]


class _Entry:
    """A wave's frames as an entry of the connection's write queue, of which aiormq's writer
    reads ``payload``, ``should_close`` and ``should_drain``: written only if the channel is
    not closing by the time the writer comes to it. A wave that waited for room in the queue
    while the broker closed the channel is queued behind the channel's Close-Ok; written, it
    would reach a channel the broker no longer has, and RabbitMQ closes the whole connection
    for that (CHANNEL_ERROR, "expected 'channel.open'"), which may be the caller's own."""

    __slots__ = ("channel", "frames")

    should_close = False
    should_drain = False

    def __init__(self, channel: _ConfirmChannel, frames: bytes) -> None:
        self.channel = channel
        self.frames = frames

    @property
    def payload(self) -> bytes:
        return b"" if self.channel.closing_begun or self.channel.is_closed else self.frames

    def drain(self) -> None:
        """Nothing waits for the entry to be written: the wave waits for its confirms."""


class _ConfirmChannel(aiormq.Channel):
    """An aiormq channel whose acks, nacks and returns go to its window. Its own class, not
    handlers set on a channel once open: aiormq 6's reader takes its handlers as it starts."""

    window: ConfirmWindow | None = None
    closing_begun = False
    """Set once the broker closed the channel or the window closes it: nothing more is
    written on it."""

    async def _on_close_frame(self, frame: spec.Channel.Close) -> None:
        # aiormq answers Close-Ok here, and marks the channel closed only a few steps later:
        # a wave written after that answer would reach a channel the broker no longer has.
        self.closing_begun = True
        await super()._on_close_frame(frame)

    async def _on_confirm_frame(self, frame: Any) -> None:
        if self.window is not None:
            self.window.confirmed(frame)

    async def _on_return_frame(self, frame: spec.Basic.Return) -> None:
        # The returned message's content follows on the channel (its confirm after it).
        header = await self._get_frame()
        if not isinstance(header, ContentHeader):
            raise ValueError(f"unexpected frame {header!r} instead of a content header")
        message = await self._read_content(frame, header)
        if self.window is not None:
            self.window.returned(message)


def server_major(connection: aiormq.abc.AbstractConnection) -> int | None:
    """The major version the RabbitMQ server said it runs, if it said."""
    version = connection.server_properties.get("version") or b""
    text = version.decode() if isinstance(version, bytes) else str(version)
    major = text.split(".", 1)[0]
    return int(major) if major.isdigit() else None


MESSAGE_MAX_3 = 128 * 1024 * 1024
"""RabbitMQ 3's default ``max_message_size``; 4's is ``MESSAGE_MAX_4``."""
MESSAGE_MAX_4 = 16 * 1024 * 1024


UNCONFIRMED_BYTES = 8 * 1024 * 1024
"""At most this many bytes written and not yet confirmed, unless a single wave is larger: a
broker that stops reading (``connection.blocked``, or a slow disk) makes a backlog of waves in
the socket's buffer, which it would take, and confirm, long after their publishes gave up."""


def unblocked(connection: aiormq.abc.AbstractConnection) -> asyncio.Event | None:
    """aiormq's record of ``connection.blocked``: an event set unless the broker blocks the
    connection (a memory or disk alarm), None if this aiormq keeps none. aiormq (6 and 7) reads
    the frames and keeps it private; ``Connection.ready()`` waits for it, but nothing tells
    without waiting whether the broker blocks, which a failure must say."""
    event = getattr(connection, "_Connection__connection_unblocked", None)
    return event if isinstance(event, asyncio.Event) else None


_unblocked_on_close: weakref.WeakSet[aiormq.abc.AbstractConnection] = weakref.WeakSet()


def unblock_on_close(connection: aiormq.abc.AbstractConnection) -> None:
    """Mark ``connection`` unblocked once it closes. aiormq's ``ready()`` waits for a
    ``connection.unblocked`` even after the connection closed: one dropped while the broker
    blocked it (a broker restarted to clear its alarm) left aio-pika's robust channel of the
    exchange waiting for ever to reopen on it, holding its restore lock, and so the robust
    connection's reconnection too, which restores that channel: nothing was published again."""
    event = unblocked(connection)
    if event is None or connection in _unblocked_on_close:
        return
    _unblocked_on_close.add(connection)
    connection.closing.add_done_callback(lambda _: event.set())


class ConfirmWindow:
    """Publishes waves on one channel in confirm mode and settles them from its confirms.

    Each message's delivery tag is counted here (tags are given in the order the broker reads
    the messages, from 1 on the channel), and each confirm settles exactly the tags it covers: a
    single ack or nack its own tag, in whichever wave holds it, a ``multiple`` one every tag up
    to its own that is not settled yet, across waves. RabbitMQ sends single confirms in any
    order (acks before nacks in one flush), and any number of waves are in flight: a relay's two
    chunks, relay groups and tenants sharing one publisher.

    A returned message (``mandatory``, routed to no queue) comes with no tag: its
    ``basic.return`` is held until a confirm settles a message with its routing key and body,
    which is then reported returned. RabbitMQ sends the return of a message before its confirm
    (other frames may come between), so a returned message always finds its return held, or
    taken by an identical copy confirmed before it. Two identical copies in flight (an event
    published again while its first copy awaits its confirm), one routed and one returned, may
    swap reports: the returned one is reported acked only when an identical message was routed,
    so the event is in a queue either way, and the routed one, reported returned, is retried (a
    duplicate, never a loss). When no copy was routed, every copy is reported returned: by the
    time the k-th of them is confirmed, the returns of those k have come and at most k - 1 were
    taken. So among the confirmed copies of a message, no more are reported acked than were
    routed (``tests/unit/test_rabbitmq_confirm_window.py`` checks it by model). A nack takes
    no return (RabbitMQ's documentation allows a return before a nack too): taken by the nack
    of an identical copy a queue refused, it would leave the returned copy reported acked.
    """

    def __init__(self, channel: _ConfirmChannel, connection: aiormq.abc.AbstractConnection) -> None:
        self.channel = channel
        self.connection = connection
        self.frame_max: int = connection.connection_tune.frame_max
        major = server_major(connection)
        # The server's default limit: RabbitMQ does not say the one it was configured with.
        self.message_max = MESSAGE_MAX_4 if major is None or major >= 4 else MESSAGE_MAX_3
        self._tag = 0  # the last delivery tag used
        # The unsettled waves in tag order (each takes the tags after the one before), and
        # their first tags, to find a tag's wave by bisection. A wave stays until the broker
        # confirmed all of it, even after its caller stopped waiting: its tags are still the
        # broker's, a return may yet come for one of its messages, and its bytes are written.
        self._waves: list[Wave] = []
        self._firsts: list[int] = []
        self._held: dict[ReturnKey, deque[aiormq.abc.DeliveredMessage]] = {}
        self.unconfirmed = 0  # bytes of the unsettled waves
        self._freed: asyncio.Future[None] | None = None  # set when a wave settles
        self._writing = asyncio.Lock()
        channel.window = self

    @classmethod
    async def open(cls, connection: aiormq.abc.AbstractConnection, timeout: float) -> ConfirmWindow:
        """A window on a new channel of ``connection``, as ``connection.channel()`` opens one
        (a free number taken under its lock), but of the class that reports to the window."""
        if connection.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError(f"{connection!r} is closed")
        async with connection.last_channel_lock:  # type: ignore[attr-defined]
            number = next(n for n in range(1, 65_536) if n not in connection.channels)
            channel = _ConfirmChannel(connection, number, publisher_confirms=True)
            connection.channels[number] = channel
        window = cls(channel, connection)
        unblock_on_close(connection)
        await channel.open(timeout=timeout)
        return window

    @property
    def is_closed(self) -> bool:
        return bool(
            self.channel.closing_begun or self.channel.is_closed or self.connection.is_closed
        )

    async def close(self, timeout: float) -> None:
        """Close the channel; nothing more is written on it from now on, not even a wave
        already queued behind what the connection has yet to write."""
        self.channel.closing_begun = True
        if not self.channel.is_closed:
            await asyncio.wait_for(self.channel.close(), timeout)

    @property
    def blocked(self) -> bool:
        """Whether the broker blocks the connection (``connection.blocked``): it reads nothing
        from it, so nothing written is confirmed until it unblocks it."""
        event = unblocked(self.connection)
        return event is not None and not event.is_set()

    def stalled(self, size: int) -> str | None:
        """Why a wave of ``size`` bytes would wait to be written, or None."""
        if self.blocked:
            # A memory or disk alarm: the broker reads nothing from publishing connections.
            return "blocked by the broker (connection.blocked: a memory or disk alarm)"
        if self.unconfirmed and self.unconfirmed + size > UNCONFIRMED_BYTES:
            return (
                f"{self.unconfirmed} bytes written are not confirmed yet (the broker reads "
                f"slowly), and no more are written beyond {UNCONFIRMED_BYTES}"
            )
        return None

    async def send(self, frames: Sequence[bytes], keys: list[ReturnKey]) -> Wave:
        """Write one message per item of ``frames`` (``keys``: each one's routing key and body)
        in one write, once the broker does not block the connection, the bytes unconfirmed
        leave room and the connection's write queue has room (the caller bounds these waits);
        their confirms settle the returned wave. Raises ``ChannelInvalidStateError`` on a
        channel closed before the wave was queued."""
        if self.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError(f"{self.channel!r} is closed")
        payload = b"".join(frames)
        entry = _Entry(self.channel, payload)
        queue = self.connection.write_queue
        # Tags are counted in the order the broker sees the messages: no other wave may be
        # queued between this one's count and its entry.
        async with self._writing:
            await self._room(len(payload))
            if self.is_closed:  # while this wave waited: the broker would not count it
                raise aiormq.exceptions.ChannelInvalidStateError(f"{self.channel!r} is closed")
            if not queue.full():
                queue.put_nowait(entry)
            else:
                # The writer is behind. A caller that gives up meanwhile leaves nothing queued
                # (``Queue.put`` puts only once it returns), and so no tags taken.
                await queue.put(entry)
                if self.is_closed:  # meanwhile: the entry writes nothing (``_Entry``)
                    raise aiormq.exceptions.ChannelInvalidStateError(f"{self.channel!r} is closed")
            # Queued, and no frame read since: these are the broker's next tags.
            wave = Wave(self._tag + 1, keys, len(payload), self.channel.create_future())
            self._tag += len(keys)
            self._waves.append(wave)
            self._firsts.append(wave.first)
            self.unconfirmed += wave.size
        return wave

    async def _room(self, size: int) -> None:
        """Wait until a wave of ``size`` bytes may be written: the broker does not block the
        connection (written, it would stay in the socket's buffer, and be taken long after its
        publish gave up and was retried), and what is unconfirmed leaves room for it (or
        nothing is)."""
        while self.stalled(size):
            event = unblocked(self.connection)
            unblocking = event.wait() if event is not None and not event.is_set() else None
            await self._settled_or(unblocking)
            if self.is_closed:
                raise aiormq.exceptions.ChannelInvalidStateError(f"{self.channel!r} is closed")

    async def _settled_or(self, other: Coroutine[Any, Any, Any] | None) -> None:
        """Wait until a wave settles, the channel closes (aiormq fails the futures it made),
        or ``other`` returns."""
        freed = self._freed
        if freed is None or freed.done():
            freed = self._freed = self.channel.create_future()
            freed.add_done_callback(_retrieve)
        waiting: set[asyncio.Future[Any]] = {freed}
        if other is not None:
            waiting.add(asyncio.ensure_future(other))
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in waiting - {freed}:
                future.cancel()

    def confirmed(self, frame: Any) -> None:
        """Settle the tags an ack or nack covers."""
        tag = frame.delivery_tag
        outcome = frame if isinstance(frame, spec.Basic.Nack) else None
        if frame.multiple:
            # Every unsettled tag up to ``tag``, in every wave that starts at or below it.
            for wave in self._waves[: bisect_right(self._firsts, tag)]:
                self._settle(wave, wave.low, min(tag - wave.first + 1, len(wave.results)), outcome)
            return
        index = bisect_right(self._firsts, tag) - 1
        if index >= 0:
            wave = self._waves[index]
            position = tag - wave.first
            if position < len(wave.results):  # else a tag of a wave settled already
                self._settle(wave, position, position + 1, outcome)

    def _settle(self, wave: Wave, start: int, end: int, outcome: Any) -> None:
        results = wave.results
        held = self._held if outcome is None else None  # a nacked message was not returned
        settled = 0
        for position in range(start, end):
            if results[position] is PENDING:
                results[position] = self._return_of(wave.keys[position]) if held else outcome
                settled += 1
        if not settled:
            return
        wave.pending -= settled
        low = wave.low
        while low < len(results) and results[low] is not PENDING:
            low += 1
        wave.low = low
        if not wave.pending:
            self._finish(wave)

    def _return_of(self, key: ReturnKey) -> aiormq.abc.DeliveredMessage | None:
        """A held return of a message with ``key``, taken; None (acked) if none is held."""
        returns = self._held.get(key)
        if not returns:
            return None
        message = returns.popleft()
        if not returns:
            del self._held[key]
        return message

    def _finish(self, wave: Wave) -> None:
        index = bisect_left(self._firsts, wave.first)
        del self._waves[index], self._firsts[index]
        self.unconfirmed -= wave.size
        if not self._waves and self._held:
            # Every message sent was confirmed, and RabbitMQ returns a message before its
            # confirm: a return still held matched none (its routing key or body changed on
            # the way?), and the message it was may have been reported published.
            log.warning(
                "RabbitMQ returned %d messages this publisher cannot match to what it sent",
                sum(map(len, self._held.values())),
            )
            self._held.clear()
        if self._freed is not None and not self._freed.done():
            self._freed.set_result(None)
        if not wave.done.done():
            wave.done.set_result(None)

    def returned(self, message: aiormq.abc.DeliveredMessage) -> None:
        """Hold a returned message until the confirm of a message it matches."""
        delivery = message.delivery
        if isinstance(delivery, spec.Basic.Return):  # always, from ``_ConfirmChannel``
            key = (delivery.routing_key or "", message.body)
            self._held.setdefault(key, deque()).append(message)


def _retrieve(future: asyncio.Future[Any]) -> None:
    # Failed when the channel closed, perhaps with no waiter left to read it.
    if not future.cancelled():
        future.exception()
