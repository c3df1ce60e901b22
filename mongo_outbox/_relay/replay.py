"""Republishing events the relay already published, for ``mongo-outbox replay``: for a consumer
that joined later, or one whose dead letters were requeued and must be delivered again.

Only collection mode keeps published entries (until the outbox's retention prunes them); the
store reads them sorted by aggregate and sequence. Each event goes out under its own id, so a
consumer's inbox still deduplicates what it already handled, and in its aggregate's order:
chunks of the sorted stream are published one after another, in waves within a chunk, and a
failure ends its aggregate (its later events are skipped, in this chunk and the next ones).
Nothing is written to MongoDB.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

from mongo_outbox._relay.rounds import Rounds
from mongo_outbox._relay.store import store_for
from mongo_outbox.brokers._publishing import Publisher
from mongo_outbox.errors import describe
from mongo_outbox.events import Event
from mongo_outbox.outbox import Outbox
from mongo_outbox.settings import RelaySettings
from mongo_outbox.status import Replayed

CHUNK = 1000
"""Events held in memory at once."""


async def replay(
    outbox: Outbox,
    connect: Callable[[], Awaitable[Publisher]] | None,
    *,
    since: datetime,
    until: datetime | None = None,
    types: Sequence[str] = (),
    aggregates: Sequence[Any] = (),
    settings: RelaySettings | None = None,
    progress: Callable[[int], None] | None = None,
) -> Replayed:
    """Republish what the outbox kept of the events that occurred since ``since`` through the
    publisher ``connect()`` returns (and closes at the end); with ``connect=None`` only count
    them. Nothing connects before the outbox has been found to keep published events, nor
    when there is nothing to send. ``progress(n)`` is told of each chunk's ``n`` events once
    they are sent (or counted, or skipped)."""
    events = store_for(outbox).published(since, until, types, aggregates)  # embedded: raises
    result = Replayed()
    rounds: Rounds | None = None
    broken: set[tuple[Any, Any]] = set()
    chunk: dict[tuple[Any, Any], list[Event]] = {}
    held = 0
    reported = 0

    async def flush() -> None:
        nonlocal held, rounds, reported
        groups = list(chunk.values())
        chunk.clear()
        if connect is not None and groups:
            if rounds is None:
                rounds = Rounds(outbox, await connect(), settings or RelaySettings())
            published, errors, _ = await rounds.publish_waves(groups)
            result.published += len(published)
            for event, error, _ in errors:
                broken.add((event.aggregate_type, event.aggregate_id))
                result.failed.append((event.id, describe(error)))
            result.skipped += held - len(published) - len(errors)
        held = 0
        if progress is not None and result.found > reported:
            progress(result.found - reported)
            reported = result.found

    seen: set[tuple[Any, Any]] = set()
    try:
        async for event in events:
            key = (event.aggregate_type, event.aggregate_id)
            result.found += 1
            result.versions[(event.type, event.version)] += 1
            seen.add(key)
            if key in broken:
                result.skipped += 1
                continue
            chunk.setdefault(key, []).append(event)
            held += 1
            if held >= CHUNK:
                await flush()
        await flush()
    finally:
        if rounds is not None:
            await rounds.publisher.aclose()
    result.aggregates = len(seen)
    return result
