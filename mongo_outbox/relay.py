"""PollingRelay: claims pending outbox entries with a lease, publishes, marks them published."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pymongo.errors import PyMongoError

from mongo_outbox._store import CollectionStore, Failure, store_for
from mongo_outbox.backoff import Backoff
from mongo_outbox.errors import describe
from mongo_outbox.events import Event, utc_now
from mongo_outbox.outbox import Outbox
from mongo_outbox.publishers.base import BatchPublisher, Publisher, unavailable

log = logging.getLogger(__name__)


@dataclass
class RelayStats:
    published: int = 0
    failed: int = 0
    last_error: str | None = None
    errors_by_type: dict[str, int] = field(default_factory=dict)


class PollingRelay:
    """Publishes an outbox's pending events, in sequence order per aggregate.

    Several relays may run side by side: each claims a batch with a lease, and an entry is
    published only after every earlier entry of its aggregate has been published, so a crashed
    relay's claims come back after ``lease`` and keep their place in line.

    Parameters:
        outbox: the Outbox to relay.
        publisher: any object with ``async publish(event)`` and ``async aclose()``.
        batch_size: entries claimed per round.
        interval: seconds to sleep when nothing is pending.
        lease: how long a claim is held; must well exceed ``publish_timeout``.
        publish_timeout: seconds to wait for one broker confirmation.
        max_in_flight: messages awaiting confirmation at once.
        backoff: delays between retries of a failed entry.
        max_attempts: attempts after which an entry is parked as dead-lettered, with its last
            error, instead of retried; ``None`` retries for ever. See ``parked()``. Failures
            for want of a broker (``BrokerUnavailableError``, timeouts, connection errors) are
            retried without counting: an outage parks nothing.
    """

    def __init__(
        self,
        outbox: Outbox,
        publisher: Publisher,
        *,
        batch_size: int = 100,
        interval: float = 1.0,
        lease: float = 30.0,
        publish_timeout: float = 10.0,
        max_in_flight: int = 256,
        backoff: Backoff | None = None,
        max_attempts: int | None = None,
    ) -> None:
        if max_attempts is not None and max_attempts < 1:
            raise ValueError("max_attempts must be at least 1 (or None: retry for ever)")
        if batch_size < 1 or max_in_flight < 1:
            raise ValueError("batch_size and max_in_flight must be at least 1")
        if not 0 < publish_timeout < lease:
            raise ValueError("publish_timeout must be positive and shorter than lease")
        self.outbox = outbox
        self.publisher = publisher
        self.batch_size = batch_size
        self.interval = interval
        self.lease = timedelta(seconds=lease)
        self.publish_timeout = publish_timeout
        self.backoff = backoff or Backoff()
        self.max_attempts = max_attempts
        self.stats = RelayStats()
        self._store = store_for(outbox)
        self.max_in_flight = max_in_flight
        self._slots = asyncio.Semaphore(max_in_flight)
        self._stopping = asyncio.Event()
        self._outage = 0  # rounds in a row in which the broker was unavailable and nothing went

    async def drain(self) -> int:
        """Publish everything claimable now; return how many events were published.
        Entries that fail are left for a later retry, not waited for."""
        total = 0
        while True:
            published, more = await self.publish_batch()
            total += published
            if not more:
                return total

    async def run(self) -> None:
        """Relay until ``stop()`` or cancellation. Database errors are logged and retried."""
        self._stopping.clear()
        failures = 0
        while not self._stopping.is_set():
            try:
                _, more = await self.publish_batch()
                failures = 0
            except PyMongoError as error:
                failures += 1
                delay = self.backoff.delay(failures)
                log.warning("relay round failed (%s); retrying in %.1fs", error, delay)
                await self._sleep(delay)
                continue
            if not more:
                await self._sleep(self.interval)

    def stop(self) -> None:
        self._stopping.set()

    async def parked(self) -> list[dict[str, Any]]:
        """Entries parked as dead-lettered: ``_id`` (the event id), the event's fields,
        ``status: "parked"``, ``attempts`` and ``last_error``; in embedded mode also
        ``collection``, as they stay in their aggregate's document."""
        return await self._store.parked()

    async def requeue(self, event_ids: Sequence[str]) -> int:
        """Make parked entries due again, with a fresh set of attempts. Returns how many were
        requeued (ids that are not parked are ignored)."""
        return await self._store.requeue(event_ids)

    async def publish_batch(self, until: datetime | None = None) -> tuple[int, bool]:
        """One round: claim (what is due by ``until``, default now), publish, settle. Returns
        (published, more may be waiting)."""
        groups, more = await self._store.claim(self.batch_size, self.lease, until)
        if not groups:
            return 0, more
        published = await self._publish_and_settle(groups)
        return published, more or bool(published)

    async def publish_entries(self, entries: Sequence[dict[str, Any]]) -> int:
        """Claim and publish these outbox entries now (e.g. just seen on a change stream),
        under the same lease and order rules as a batch. Returns how many were published."""
        if not isinstance(self._store, CollectionStore):
            raise ValueError("publish_entries needs a collection-mode outbox")
        groups = await self._store.claim_entries(entries, self.lease)
        return await self._publish_and_settle(groups) if groups else 0

    async def _publish_and_settle(self, groups: Sequence[Sequence[Event]]) -> int:
        published, failed = await self._publish(groups)
        await self._store.settle(published, failed)
        self.stats.published += len(published)
        self.stats.failed += len(failed)
        waiting = [f for f in failed if not f.counted]
        self._outage = 0 if published or not waiting else self._outage + 1
        if waiting:
            log.warning(
                "broker unavailable for %d events (%s); retrying in %.1fs or later",
                len(waiting),
                waiting[0].error,
                max((min(f.retry_at for f in waiting) - utc_now()).total_seconds(), 0.0),
            )
        return len(published)

    async def _publish(
        self, groups: Sequence[Sequence[Event]]
    ) -> tuple[list[Event], list[Failure]]:
        published: list[Event] = []
        failed: list[Failure] = []
        # Wave k holds the k-th event of every aggregate: an event goes out only once its
        # predecessor is confirmed, so a failure can never let a later event overtake it.
        queues = [list(reversed(group)) for group in groups]
        while queues:
            wave = [queue.pop() for queue in queues]
            results = await self._publish_wave(wave)
            survivors = []
            for event, queue, error in zip(wave, queues, results, strict=True):
                if error is None:
                    published.append(event)
                    if queue:
                        survivors.append(queue)
                else:
                    failed.append(self._failure(event, error))
            queues = survivors
        return published, failed

    async def _publish_wave(self, wave: list[Event]) -> list[BaseException | None]:
        if not isinstance(self.publisher, BatchPublisher):
            return list(await asyncio.gather(*(self._publish_one(e) for e in wave)))
        publisher = self.publisher
        # Two half-size chunks in flight at once: one is being sent while the other awaits its
        # acks, so the pipe never drains, and never holds more than max_in_flight messages.
        size = max(1, self.max_in_flight // 2)
        chunks = [wave[start : start + size] for start in range(0, len(wave), size)]
        turns = asyncio.Semaphore(2)

        async def publish_chunk(chunk: list[Event]) -> list[BaseException | None]:
            async with turns:
                try:
                    return await asyncio.wait_for(
                        publisher.publish_many(chunk), self.publish_timeout
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # noqa: BLE001 - the whole chunk is retried later
                    return [error] * len(chunk)

        done = await asyncio.gather(*(publish_chunk(chunk) for chunk in chunks))
        return [result for chunk_results in done for result in chunk_results]

    async def _publish_one(self, event: Event) -> BaseException | None:
        async with self._slots:
            try:
                await asyncio.wait_for(self.publisher.publish(event), self.publish_timeout)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - any broker failure is retried later
                return error
        return None

    def _failure(self, event: Event, error: BaseException) -> Failure:
        text = describe(error)
        self.stats.last_error = text
        name = type(error).__name__
        self.stats.errors_by_type[name] = self.stats.errors_by_type.get(name, 0) + 1
        if unavailable(error):
            # Not the event's fault: it keeps its attempts, and waits longer the longer the
            # outage lasts (one warning per round says so, not one per event).
            delay = self.backoff.delay(self._outage + 1)
            return Failure(event, text, utc_now() + timedelta(seconds=delay), counted=False)
        attempt = self._store.attempts.get(event.id, 0) + 1
        delay = self.backoff.delay(attempt)
        park = self.max_attempts is not None and attempt >= self.max_attempts
        if park:
            log.error("parking %s after %d failed attempts: %s", event.id, attempt, text)
        else:
            log.warning(
                "publishing %s failed (attempt %d), retry in %.1fs: %s",
                event.id,
                attempt,
                delay,
                text,
            )
        return Failure(event, text, utc_now() + timedelta(seconds=delay), park)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
