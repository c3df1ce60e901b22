"""Run a guarded handler on a Redis stream through a consumer group, and settle each entry.

An entry is acknowledged (XACK) only once the guard has stored its outcome. Redis keeps every
entry a consumer read and did not acknowledge in the group's pending list, with the time since
it was last delivered (its idle time): ``consume_redis`` reclaims (XAUTOCLAIM) entries idle for
``claim_idle``, those of a consumer that died mid-handler, so another consumer finishes them.
While an entry is in the process it resets the entry's idle time every third of ``claim_idle``,
so a slow handler's entry is not reclaimed from under it.

A retry is not held in the process: the entry stays pending, its idle time set to
``claim_idle - delay``, so that it is reclaimed (by any consumer of the group) once the backoff
delay has passed, or after ``claim_idle`` when the delay is longer. Redis has no delivery limit
and no dead-letter destination of its own: a dead-lettered entry, and one that cannot be handled
at all (no ``event-id`` field, a body that is not an Event), is added to the dead-letter stream
and then acknowledged, never dropped. ``max_deliveries`` (XPENDING's delivery
count) makes a delivery the last, like a quorum queue's delivery limit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid

from mongo_outbox.brokers._consuming import (
    Dispatcher,
    Rejected,
    being_cancelled,
    check_source,
    ready,
)
from mongo_outbox.errors import ConfigurationError, describe
from mongo_outbox.inbox import Guarded
from mongo_outbox.settings import Duration, check_count, check_seconds

try:
    import redis.asyncio
    import redis.exceptions

    # Imports redis too: after the check that names the extra.
    from mongo_outbox.brokers.redis._entries import Entries, Reader
    from mongo_outbox.brokers.redis.errors import is_outage
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the Redis consumer needs the redis extra: pip install 'mongo-outbox[redis]'"
    ) from error

log = logging.getLogger(__name__)

_OUTAGE_PAUSE = 1.0  # seconds between attempts while Redis cannot be reached
# The stream or the group is gone (deleted, or a Redis restarted without its data): NOGROUP for
# a read that starts then, UNBLOCKED for one that was waiting on the stream.
_GONE = ("NOGROUP", "UNBLOCKED")


def default_consumer_name() -> str:
    """``host-pid-random``: a consumer name no other process of the group uses."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


async def consume_redis(
    client: redis.asyncio.Redis,
    stream: str,
    group: str,
    guarded: Guarded,
    *,
    consumer: str | None = None,
    dead_letter_stream: str | None = None,
    claim_idle: Duration = 30.0,
    max_deliveries: int | None = None,
    start_id: str = "0",
    ordered: bool = False,
    batch: int = 32,
    max_in_flight: int | None = None,
    source: str | None = None,
    rejected: Rejected | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Read ``stream`` as ``consumer`` of ``group`` until ``stop`` is set or the task is
    cancelled, creating the group (and the stream) if absent.

    Parameters:
        client: a ``redis.asyncio.Redis`` client; it stays the caller's.
        consumer: this consumer's name in the group; default: one of its own
            (``default_consumer_name``). The entries a consumer left pending when it stopped
            or died are reclaimed after ``claim_idle``, whatever name reclaims them.
        dead_letter_stream: where entries that cannot or must not be handled go; default
            ``"{stream}:dead"``.
        claim_idle: seconds (or a ``timedelta``) an entry stays pending, unacknowledged and
            untouched, before any consumer of the group reclaims it: longer than a handler
            may take without this consumer's keep-alive (a stalled process), shorter than you
            would wait for a crashed consumer's entries.
        max_deliveries: deliveries of an entry after which a failure is dead-lettered;
            ``None``: unlimited (the guard's ``max_attempts`` still bounds the handler's runs).
        start_id: where a group created here starts: ``"0"`` (default) reads what the stream
            already holds, ``"$"`` only what is added from now on.

    ``ordered``, ``batch``, ``max_in_flight``, ``source``, ``rejected`` and ``stop`` are as for
    ``consume_nats``. On stop, running handlers finish and settle, and entries held for a retry
    or waiting their turn are made reclaimable at once.
    """
    for setting, value in (("consume_redis.stream", stream), ("consume_redis.group", group)):
        if not isinstance(value, str) or not value:
            raise ConfigurationError(
                f"{setting} must be a non-empty str, not {value!r}", setting=setting
            )
    consumer = default_consumer_name() if consumer is None else consumer
    dead = f"{stream}:dead" if dead_letter_stream is None else dead_letter_stream
    if not consumer or not dead or dead == stream:
        raise ConfigurationError(
            "consume_redis needs a consumer name and a dead-letter stream other than the stream",
            setting="consume_redis.dead_letter_stream",
        )
    idle = check_seconds(claim_idle, "consume_redis.claim_idle")
    if idle * 1000 >= 2**62:  # Redis takes idle times in milliseconds, as a 64-bit integer
        raise ConfigurationError(
            f"consume_redis.claim_idle is too long: {idle:g} s", setting="consume_redis.claim_idle"
        )
    # 0 would mean "no delivery": refused rather than taken as unlimited (None says that).
    limit_deliveries = (
        None
        if max_deliveries is None
        else check_count(max_deliveries, "consume_redis.max_deliveries")
    )
    batch = check_count(batch, "consume_redis.batch")
    limit = (
        batch
        if max_in_flight is None
        else check_count(max_in_flight, "consume_redis.max_in_flight")
    )
    check_source(source, "consume_redis.source")
    stop = stop or asyncio.Event()
    await ready(guarded)
    entries = Entries(client, stream, group, consumer, dead, int(idle * 1000))
    reader = Reader(entries, start_id, limit_deliveries)
    await reader.ensure_group()
    dispatcher = Dispatcher(guarded, source=source, rejected=rejected, ordered=ordered)
    ticker = asyncio.create_task(_keep_alive(entries, idle / 3))
    regroup = False
    try:
        while not stop.is_set():
            await dispatcher.room(limit, stop)
            if stop.is_set():
                break
            wanted = min(batch, limit - len(dispatcher.in_flight))
            try:
                if regroup:
                    await reader.ensure_group()
                    regroup = False
                deliveries = await reader.read(wanted)
            except UnicodeDecodeError as error:
                # redis-py decodes the whole answer: the entry cannot even be named, let alone
                # dead-lettered, and every restart would meet it again.
                raise ConfigurationError(
                    f"stream {stream} holds an entry that is not UTF-8 text, which a client with "
                    "decode_responses=True cannot read: give consume_redis a client without it",
                    setting="consume_redis.client",
                ) from error
            except redis.exceptions.RedisError as error:
                if _gone(error):
                    log.warning("group %s of stream %s is gone: creating it again", group, stream)
                    regroup = True
                    continue
                # A lost connection, a timeout, a failover's read-only replica, a master down.
                if not is_outage(error):
                    raise
                log.warning("reading stream %s: %s; trying again", stream, describe(error))
                await asyncio.sleep(_OUTAGE_PAUSE)
                continue
            for delivery in deliveries:
                dispatcher.dispatch(delivery)
    finally:
        try:
            await dispatcher.drain(cancelled=being_cancelled())
        finally:
            # Even if the drain was cancelled: a keep-alive left running would hold its
            # messages from every other consumer for as long as the process lives.
            ticker.cancel()


def _gone(error: redis.exceptions.RedisError) -> bool:
    return isinstance(error, redis.exceptions.ResponseError) and str(error).startswith(_GONE)


async def _keep_alive(entries: Entries, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await entries.keep_alive()
        except Exception as error:  # noqa: BLE001 - the next tick, or a reclaim
            log.warning("keep-alive of held entries failed: %s", describe(error))
