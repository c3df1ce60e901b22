"""One publishing round, shared by both relays: claim, publish in waves, settle.

Wave k holds the k-th claimed event of every aggregate: an event goes out only once its
predecessor is confirmed, so a failure can never let a later event overtake it. A round starts
no wave that could outlast its claim (``claim_lease`` minus a tenth for the settle), so a slow
broker cannot let the claim run out while this relay still publishes, and stops before the next
wave the moment its caller's ``lost`` event is set (a relay that lost its leader lease).

Failures are classified here (see docs/failures.md): an event the broker cannot carry is parked
at once; a failure for want of a broker waits without counting, its delay growing with the
event's own waits, and is woken as soon as the broker confirms anything again; anything else
counts an attempt, and ``max_attempts`` parks the event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from mongo_outbox._store import Claim, Failure, Kind, store_for
from mongo_outbox.errors import BrokerFullError, InvalidEventError, UsageError, describe
from mongo_outbox.events import Event, utc_now
from mongo_outbox.outbox import Outbox
from mongo_outbox.publishers.base import (
    BatchPublisher,
    Publisher,
    check_publisher,
    closed_error,
    unavailable,
)
from mongo_outbox.settings import RelaySettings
from mongo_outbox.stats import RelayStats

log = logging.getLogger("mongo_outbox.relay")

WAKE_EVERY = 1.0
"""Seconds between two looks for entries that wait for the broker, once it confirms again."""
PROBE_EVERY = 1.0
"""Seconds between two probes during an outage: one waiting entry is retried at a time."""


class Rounds:
    def __init__(self, outbox: Outbox, publisher: Publisher, settings: RelaySettings) -> None:
        check_publisher(publisher)
        if not isinstance(settings, RelaySettings):
            raise TypeError(f"settings must be a RelaySettings, not {type(settings).__name__}")
        self.store = store_for(outbox)
        self.publisher = publisher
        self.settings = settings
        self.stats = RelayStats()
        self.outage = False  # the last round found the broker unavailable and confirmed nothing
        self._woke_at = float("-inf")
        self._probed_at = float("-inf")
        self._busy = False

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """Refuse a second loop of one relay object while one runs: two loops would share one
        stop flag, one set of stats and, for a change-stream relay, one lease."""
        if self._busy:
            raise UsageError(
                f"{what}: this relay is already running a loop (run(), drain() or "
                "publish_batch()); one relay object runs one loop at a time: create another "
                "relay object (or process) to publish side by side"
            )
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    async def batch(
        self, until: datetime | None = None, lost: asyncio.Event | None = None
    ) -> tuple[int, bool]:
        """Claim what is due by ``until`` (default now), publish, settle. Returns (published,
        more may be waiting)."""
        await self.probe()
        started = asyncio.get_running_loop().time()
        claim = await self.store.claim(self.settings.batch_size, self.settings.lease, until)
        published, parked = await self._round(claim, started, lost)
        # A park frees what queued behind it at once, so more may be due as well.
        return published, claim.more or bool(published or parked)

    async def changes(
        self, changes: Sequence[Mapping[str, Any]], lost: asyncio.Event | None = None
    ) -> tuple[int, bool]:
        """Claim and publish what these change-stream changes brought. Returns (published,
        whether some could not be claimed and deserve a sweep soon)."""
        started = asyncio.get_running_loop().time()
        claim = await self.store.claim_changes(changes, self.settings.lease)
        published, _ = await self._round(claim, started, lost)
        return published, claim.more or claim.events > published

    async def probe(self) -> bool:
        """During an outage, make one waiting entry due (at most once a second), so the next
        round finds out whether the broker is back. Returns whether it woke one."""
        loop = asyncio.get_running_loop()
        if not self.outage or loop.time() - self._probed_at < PROBE_EVERY:
            return False
        self._probed_at = loop.time()
        return bool(await self.store.wake(limit=1))

    async def _round(
        self, claim: Claim, started: float, lost: asyncio.Event | None
    ) -> tuple[int, int]:
        """Publish and settle one claim; returns how many were published and parked."""
        if not claim.groups and not claim.held:
            return 0, 0
        deadline = started + self.settings.lease.total_seconds() * 0.9 - self.settings.timeout
        published, failed = await self.publish_claim(claim, deadline, lost)
        await self.store.settle(claim, published, failed)
        self.stats.published += len(published)
        self.stats.failed += len(failed)
        parked = sum(f.kind == "park" for f in failed)
        self.stats.parked += parked
        waits = [f for f in failed if f.kind == "wait"]
        if published:
            self.outage = False
            loop = asyncio.get_running_loop()
            if loop.time() - self._woke_at >= WAKE_EVERY:
                # The broker confirms again: what waited for it is due now, not after its
                # backoff (which grew during the outage).
                self._woke_at = loop.time()
                await self.store.wake()
        elif waits:
            self.outage = True
        if waits:
            log.warning(
                "broker unavailable for %d events (%s); retrying in %.1fs or as soon as it "
                "confirms again",
                len(waits),
                waits[0].error,
                max((min(f.retry_at for f in waits) - utc_now()).total_seconds(), 0.0),
            )
        return len(published), parked

    async def publish_claim(
        self, claim: Claim, deadline: float = math.inf, lost: asyncio.Event | None = None
    ) -> tuple[list[Event], list[Failure]]:
        """Publish a claim's events in waves, starting none after ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        published: list[Event] = []
        failed: list[Failure] = []
        queues = [list(reversed(group)) for group in claim.groups]
        while queues and loop.time() <= deadline and not (lost and lost.is_set()):
            wave = [queue.pop() for queue in queues]
            results = await self._publish_wave(wave)
            confirmed = bool(published) or any(r is None for r in results)
            survivors = []
            for event, queue, error in zip(wave, queues, results, strict=True):
                if error is None:
                    published.append(event)
                    if queue:
                        survivors.append(queue)
                else:
                    failed.append(self._failure(event, error, claim, confirmed))
            queues = survivors
        # What is left unpublished is released by settle, due at once, still in order.
        return published, failed

    async def _publish_wave(self, wave: list[Event]) -> list[BaseException | None]:
        publisher = self.publisher
        if not isinstance(publisher, BatchPublisher):
            slots = asyncio.Semaphore(self.settings.max_in_flight)

            async def one(event: Event) -> BaseException | None:
                async with slots:
                    result = await self._confirm(publisher.publish(event), event)
                return result if isinstance(result, BaseException) else None

            return list(await asyncio.gather(*map(one, wave)))
        # Two half-size chunks in flight at once: one is being sent while the other awaits its
        # acks, so the pipe never drains, and never holds more than max_in_flight messages.
        size = max(1, self.settings.max_in_flight // 2)
        chunks = [wave[start : start + size] for start in range(0, len(wave), size)]
        turns = asyncio.Semaphore(2)

        async def chunk_of(chunk: list[Event]) -> list[BaseException | None]:
            async with turns:
                result = await self._confirm(publisher.publish_many(chunk), chunk[0])
            if isinstance(result, list) and len(result) == len(chunk):
                return result
            error = result if isinstance(result, BaseException) else None
            return [error or TypeError("publish_many returned no result per event")] * len(chunk)

        done = await asyncio.gather(*map(chunk_of, chunks))
        return [result for results in done for result in results]

    async def _confirm(self, call: Any, event: Event) -> Any:
        """Await a publisher call within ``publish_timeout``. Returns its result, or the error
        it failed with. Only this relay's own cancellation propagates: a ``CancelledError``
        from inside the publisher (its client closed under it) is a failure like any other."""
        task = asyncio.ensure_future(call)
        task.add_done_callback(_retrieve)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.settings.timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            return asyncio.TimeoutError(
                f"no broker confirmation within {self.settings.timeout:g} s"
            )
        if task.cancelled():
            return closed_error(self.publisher, event)
        return task.exception() or task.result()

    def _failure(
        self, event: Event, error: BaseException, claim: Claim, confirmed: bool
    ) -> Failure:
        text = describe(error)
        self.stats.last_error = text
        name = type(error).__name__
        self.stats.errors_by_type[name] = self.stats.errors_by_type.get(name, 0) + 1
        attempt = claim.attempts.get(event.id, 0) + 1
        waits = claim.waits.get(event.id, 0)
        limit = self.settings.max_attempts
        kind: Kind = "retry"
        if isinstance(error, InvalidEventError):
            kind = "park"  # the broker cannot carry it: no retry would help
        elif unavailable(error) and not (
            # A destination missing for this event alone, for longer than the attempt budget,
            # while the broker confirms others, is the event's own (docs/failures.md).
            confirmed
            and getattr(error, "destination", None)
            and not isinstance(error, BrokerFullError)
            and limit is not None
            and waits >= limit
        ):
            # Not the event's fault: it keeps its attempts, and waits longer the more often it
            # met no broker (one warning per round says so, not one per event).
            delay = self.settings.backoff.delay(waits + 1)
            return Failure(event, text, utc_now() + timedelta(seconds=delay), "wait")
        elif limit is not None and attempt >= limit:
            kind = "park"
        if kind == "park":
            log.error("parking %s after %d attempts: %s", event.id, attempt, text)
            return Failure(event, text, utc_now(), "park")
        delay = self.settings.backoff.delay(attempt)
        log.warning(
            "publishing %s failed (attempt %d), retry in %.1fs: %s", event.id, attempt, delay, text
        )
        return Failure(event, text, utc_now() + timedelta(seconds=delay), "retry")


def _retrieve(task: asyncio.Future[Any]) -> None:
    # A publish abandoned at its timeout may still fail later; its error was already reported.
    if not task.cancelled():
        task.exception()
