"""One publishing round, shared by both relays: claim, publish in waves, settle.

Wave k holds the k-th claimed event of every aggregate: an event goes out only once its
predecessor is confirmed, so a failure can never let a later event overtake it. A round starts
no publish that could outlast its claim (``claim_lease`` minus a tenth for the settle), also in
a wave wider than ``max_in_flight``, so a slow broker cannot let the claim run out while this
relay still publishes; and it stops before the next wave (and starts no publish of its wave
not yet started) the moment its caller's ``lost`` flag is set: a relay that lost its lease, or
was asked to stop (``AnyOf``); what it did not publish is released, due at once, in order.
Each publish runs in a producer span (``tracing.py``) when a tracer provider is configured.

Failures are classified by ``failures`` (see docs/failures.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from mongo_outbox import metrics
from mongo_outbox._driver import answered
from mongo_outbox._relay.failures import Classifier
from mongo_outbox._relay.store import store_for
from mongo_outbox._relay.store.base import Claim, PublishFailure
from mongo_outbox._relay.turns import Turns
from mongo_outbox.brokers._publishing import (
    Publisher,
    WavePublisher,
    check_publisher,
    client_call,
)
from mongo_outbox.errors import (
    BrokerUnavailableError,
)
from mongo_outbox.events import Event, utc_now
from mongo_outbox.outbox import Outbox
from mongo_outbox.settings import RelaySettings
from mongo_outbox.status import RelayCounters, RelayStatus, State
from mongo_outbox.tracing import publishing, tracer

log = logging.getLogger("mongo_outbox.relay")
T = TypeVar("T")

WAKE_EVERY = 1.0
"""Seconds between two looks for entries that wait for the broker, once it confirms again."""
PROBE_EVERY = 1.0
"""Seconds between two probes during an outage: one waiting entry is retried at a time."""
OUTAGE_LOG_EVERY = 60.0
"""Seconds between two warnings of one outage: each probe's failure needs no line of its own."""
COMMAND_WAIT_AT_LEAST = 10.0
"""Seconds a round's MongoDB command may take at the least, whatever the leases: a loaded
server's slow answer is no hang."""


class Flag(Protocol):
    """What a round asks of its ``lost`` flag: an ``asyncio.Event``, or ``AnyOf`` several."""

    def is_set(self) -> bool: ...


class AnyOf:
    """A flag set while any of ``flags`` is: a lost lease or a stop, say."""

    def __init__(self, *flags: Flag) -> None:
        self.flags = flags

    def is_set(self) -> bool:
        return any(flag.is_set() for flag in self.flags)


class Rounds:
    def __init__(
        self,
        outbox: Outbox,
        publisher: Publisher,
        settings: RelaySettings,
        partition: int | None = None,
        relay: str | None = None,  # the relay's name in metrics; None: not a relay's rounds
    ) -> None:
        check_publisher(publisher)
        if not isinstance(settings, RelaySettings):
            raise TypeError(f"settings must be a RelaySettings, not {type(settings).__name__}")
        self.store = store_for(outbox, partition, relay)
        self.publisher = publisher
        self.settings = settings
        self.stats = RelayCounters()
        self.relay = (
            None if relay is None else metrics.relay_labels(relay, outbox.db.name, partition)
        )
        self._classify = Classifier(settings, self.stats, self.relay)
        # The last round found the broker unavailable and confirmed nothing. A relay starts as
        # if it did: one probe finds out, in case it was restarted during an outage.
        self.outage = True
        self._wake_due = False  # a wake was skipped inside WAKE_EVERY: do it at the next probe
        self._woke_at = float("-inf")
        self._probed_at = float("-inf")
        self._warned_at = float("-inf")
        self._late_told_at = float("-inf")  # when a claim that left no time was last told
        self.turns: Turns | None = None
        """Shared with other tenants' relays (``TenantRelays``): a round waits for its turn."""
        self.tenant = outbox.db.name
        self.command_wait = max(settings.claim_lease, COMMAND_WAIT_AT_LEAST)
        """The longest a round waits for one MongoDB command (a relay with a longer lease of
        its own raises it to that lease)."""

    def answered(self, commands: Awaitable[T]) -> Awaitable[T]:
        """``commands`` bounded by ``command_wait``: one that got no answer (a connection hung
        without a reset, a server that stopped answering) fails as a MongoDB error, which the
        relay backs off from and retries on another connection. Unbounded, it held the relay
        for ever while the lease's heartbeat, on another connection, went on renewing the
        lease, so no other relay could take over."""
        return answered(commands, self.command_wait)

    def _turn(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.turns.turn(self.tenant) if self.turns else contextlib.nullcontext()

    def limit(self, timed: bool = True) -> int:
        """How many entries (documents, in embedded mode) the next round may take: the
        ``batch_size`` setting, or this tenant's share of it while it takes turns with others
        (``Turns.share``; ``timed``: also bounded by the time its turns took)."""
        limit = self.settings.batch_size
        if self.turns is None:
            return limit
        return self.turns.share(self.tenant, limit, timed=timed)

    async def status(
        self,
        name: str,
        state: Callable[[], tuple[State, bool]],
        *,
        checkpoint_at: datetime | None = None,
        recoveries: int = 0,
        last_error: Callable[[], str | None] = lambda: None,
    ) -> RelayStatus:
        """What both relays' ``status()`` report: the outbox's backlog and parked entries as
        the store reads them now, and the relay's ``state()`` (state, active) as it is once
        they are read, not as it was before."""
        backlog = await self.store.backlog()
        parked = await self.store.parked_count()
        now_state, active = state()
        return RelayStatus(
            name=name,
            state=now_state,
            active=active,
            last_checkpoint_at=checkpoint_at,
            pending=backlog.pending,
            oldest_pending_age=utc_now() - backlog.oldest if backlog.oldest else None,
            parked=parked,
            publish_failures=self.stats.failed,
            recoveries=recoveries,
            last_error=last_error() or self.stats.last_error,
        )

    async def drain(self) -> int:
        """Publish what is due now, round after round; return how many were published. Only
        what was due when it began: a busy writer cannot keep it going for ever."""
        until, total, more = utc_now(), 0, True
        while more:
            published, more, freed = await self._one(until, None)
            total += published
            if freed:
                # A park, or a round cut short, made entries that were due at the start due
                # again now: they count as due. Each such round publishes or parks something.
                until = utc_now()
        return total

    async def one(
        self, until: datetime | None = None, lost: Flag | None = None
    ) -> tuple[int, bool]:
        """Claim what is due by ``until`` (default now), publish, settle. Returns (published,
        more may be waiting)."""
        published, more, _ = await self._one(until, lost)
        return published, more

    async def _one(self, until: datetime | None, lost: Flag | None) -> tuple[int, bool, bool]:
        async with self._turn():
            await self.probe()
            started = asyncio.get_running_loop().time()
            limit = self.limit()
            claim = await self.answered(
                self.store.claim(limit, timedelta(seconds=self.settings.claim_lease), until)
            )
            if self.turns is not None and claim.events:
                self.turns.worked(self.tenant)
        published, freed = await self._round(claim, started, lost)
        if self.turns is not None:
            self.turns.sized(self.tenant, limit, full=claim.more)
        # A park frees what queued behind it at once, so more may be due as well.
        return published, claim.more or bool(published or freed), bool(freed)

    async def changes(
        self, changes: Sequence[Mapping[str, Any]], lost: Flag | None = None
    ) -> tuple[int, bool]:
        """Claim and publish what these change-stream changes brought. Returns (published,
        whether some could not be claimed and deserve a sweep soon)."""
        async with self._turn():
            started = asyncio.get_running_loop().time()
            claim = await self.answered(
                self.store.claim_changes(changes, timedelta(seconds=self.settings.claim_lease))
            )
            if self.turns is not None and claim.events:
                self.turns.worked(self.tenant)
        published, _ = await self._round(claim, started, lost)
        return published, claim.more or claim.events > published

    async def probe(self) -> bool:
        """During an outage, make one waiting entry due (at most once a second), so the next
        round finds out whether the broker is back; after one, do a wake that was skipped.
        Returns whether it made anything due."""
        now = asyncio.get_running_loop().time()
        if self._wake_due and now - self._woke_at >= WAKE_EVERY:
            return await self._wake(now)
        if not self.outage or now - self._probed_at < PROBE_EVERY:
            return False
        self._probed_at = now
        return bool(await self.answered(self.store.wake(limit=1)))

    async def _wake(self, now: float) -> bool:
        # The broker confirms again: what waited for it is due now, not after its backoff
        # (which grew during the outage).
        self._wake_due, self._woke_at = False, now
        return bool(await self.answered(self.store.wake()))

    async def _round(self, claim: Claim, started: float, lost: Flag | None) -> tuple[int, int]:
        """Publish and settle one claim; returns how many were published, and how many entries
        it made due at once (parked ones free their followers; a round cut short releases the
        rest)."""
        if not claim.groups and not claim.held:
            return 0, 0
        deadline = started + self.settings.claim_lease * 0.9 - self.settings.publish_timeout
        # Publishing waits for the broker, not MongoDB: no turn, so a hanging publish of one
        # tenant holds up no other; its claim and settle (MongoDB's work) take turns.
        published, failed, left = await self.publish_claim(claim, deadline, lost)
        async with self._turn():
            await self.answered(self.store.settle(claim, published, failed))
        if left and not published and not failed and not (lost and lost.is_set()):
            self._late(asyncio.get_running_loop().time() - started)
        self.stats.published += len(published)
        metrics.published(self.relay, len(published))
        self.stats.failed += len(failed)
        parked = sum(f.kind == "park" for f in failed)
        self.stats.parked += parked
        waits = [f for f in failed if f.kind == "wait"]
        if published:
            self.outage = False
            self._warned_at = float("-inf")  # the next outage is told at once
            now = asyncio.get_running_loop().time()
            if now - self._woke_at >= WAKE_EVERY:
                await self._wake(now)
            else:
                self._wake_due = True
        elif any(f.wake for f in waits):
            self.outage = True
        if waits:
            self._warn(waits)
        return len(published), parked + left

    def _late(self, took: float) -> None:
        """Tell that a round published nothing because its claim left no time for a publish:
        released at once, the entries are claimed again by a round that may run as late, so
        a MongoDB slower than the lease allows stalls the relay without another sign."""
        now = asyncio.get_running_loop().time()
        if now - self._late_told_at < OUTAGE_LOG_EVERY:
            return
        self._late_told_at = now
        log.warning(
            "a round took %.2fs of its %gs claim before a publish could start, so it published "
            "nothing (its entries are released, in order): MongoDB answers slower than "
            "claim_lease allows (at least publish_timeout, %gs, must be left); raise "
            "RelaySettings.claim_lease",
            took,
            self.settings.claim_lease,
            self.settings.publish_timeout,
        )

    def _warn(self, waits: list[PublishFailure]) -> None:
        """Tell that events wait for the broker, as the relay then behaves: during an outage it
        probes with one event every PROBE_EVERY (each failed probe is a round of its own), so
        one line starts the outage and one more per OUTAGE_LOG_EVERY says it goes on."""
        retry = max((min(f.retry_at for f in waits) - utc_now()).total_seconds(), 0.0)
        if not self.outage:
            log.warning(
                "broker unavailable for %d events (%s); retrying them in %.1fs",
                len(waits),
                waits[0].error,
                retry,
            )
            return
        now = asyncio.get_running_loop().time()
        if now - self._warned_at < OUTAGE_LOG_EVERY:
            log.debug("broker still unavailable (%s)", waits[0].error)
            return
        self._warned_at = now
        log.warning(
            "broker unavailable (%s): %d events wait; probing it with one event every %.0fs "
            "(a probe may take up to the publish timeout, %gs), retrying them in %.1fs or as "
            "soon as it confirms again; repeated every %.0fs while it stays down",
            waits[0].error,
            len(waits),
            PROBE_EVERY,
            self.settings.publish_timeout,
            retry,
            OUTAGE_LOG_EVERY,
        )

    async def publish_claim(
        self, claim: Claim, deadline: float = math.inf, lost: Flag | None = None
    ) -> tuple[list[Event], list[PublishFailure], int]:
        """Publish a claim's events in waves, starting none after ``deadline`` (loop time).
        Returns what was published, what failed, and how many were left for lack of time."""
        published, errors, left = await self.publish_waves(claim.groups, deadline, lost)
        failed = [
            self._classify(event, error, claim, confirmed) for event, error, confirmed in errors
        ]
        return published, failed, left

    async def publish_waves(
        self,
        groups: Sequence[Sequence[Event]],
        deadline: float = math.inf,
        lost: Flag | None = None,
    ) -> tuple[list[Event], list[tuple[Event, BaseException, bool]], int]:
        """Publish groups of events, each group in its order, in waves: a group's next event
        goes out once its previous one is confirmed, and a failure ends its group. Returns what
        was published; each failure with its error and whether the broker had confirmed
        others by then; and how many were left for lack of time (a group cut short by a
        failure counts in neither)."""
        loop = asyncio.get_running_loop()
        published: list[Event] = []
        errors: list[tuple[Event, BaseException, bool]] = []
        queues = [list(reversed(group)) for group in groups]
        left = 0
        while queues and loop.time() <= deadline and not (lost and lost.is_set()):
            wave = [queue.pop() for queue in queues]
            results = await self._publish_wave(wave, deadline, lost)
            confirmed = bool(published) or any(r is None for r in results)
            survivors = []
            for event, queue, error in zip(wave, queues, results, strict=True):
                if error is None:
                    published.append(event)
                    if queue:
                        survivors.append(queue)
                elif isinstance(error, _NotStarted):
                    left += 1 + len(queue)
                else:
                    errors.append((event, error, confirmed))
            queues = survivors
        # What is left unpublished is released by settle, due at once, still in order.
        return published, errors, left + sum(map(len, queues))

    async def _publish_wave(
        self, wave: list[Event], deadline: float, lost: Flag | None = None
    ) -> list[BaseException | None]:
        """Publish a wave with at most ``max_in_flight`` awaiting confirmation. A publish that
        gets its turn only after ``deadline`` is not started: it could end after the claim;
        nor one after ``lost`` was set (the lease it needs is gone, or the relay stops)."""
        loop = asyncio.get_running_loop()

        def late() -> bool:
            return loop.time() > deadline or (lost is not None and lost.is_set())

        publisher = self.publisher
        traced = tracer()  # once per wave: asking the API for its provider is not free
        if not isinstance(publisher, WavePublisher):
            # max_in_flight workers take the events in turn: a task per worker, not per event.
            results: list[BaseException | None] = [None] * len(wave)
            order = iter(range(len(wave)))

            async def worker() -> None:
                for i in order:
                    if late():
                        results[i] = _NotStarted()
                        continue
                    event = wave[i]
                    spans = publishing(traced, publisher, (event,))
                    sent = spans.sent[0] if spans else event
                    result = await self._confirm(publisher.publish(sent), event)
                    error = result if isinstance(result, BaseException) else None
                    if spans:
                        spans.end((error,))
                    results[i] = error

            workers = min(len(wave), self.settings.max_in_flight)
            await _all([worker() for _ in range(workers)])
            return results
        # Two half-size chunks in flight at once: one is being sent while the other awaits its
        # acks, so the pipe never drains, and never holds more than max_in_flight messages.
        size = max(1, self.settings.max_in_flight // 2)
        chunks = [wave[start : start + size] for start in range(0, len(wave), size)]
        turns = asyncio.Semaphore(2)

        async def chunk_of(chunk: list[Event]) -> list[BaseException | None]:
            async with turns:
                if late():
                    return [_NotStarted()] * len(chunk)
                spans = publishing(traced, publisher, chunk)
                sent = spans.sent if spans else chunk
                result = await self._confirm(publisher.publish_many(sent), chunk[0])
            if not (isinstance(result, list) and len(result) == len(chunk)):
                error = result if isinstance(result, BaseException) else None
                result = [error or TypeError("publish_many returned no result per event")]
                result *= len(chunk)
            if spans:
                spans.end(result)
            return result

        done = await _all([chunk_of(chunk) for chunk in chunks])
        return [result for results in done for result in results]

    async def _confirm(self, call: Any, event: Event) -> Any:
        """Await a publisher call within ``publish_timeout``. Returns its result, or the error
        it failed with. Only this relay's own cancellation propagates: a ``CancelledError``
        from inside the publisher (its client closed under it) is a failure like any other."""

        def failed(reason: str) -> BrokerUnavailableError:
            name = type(self.publisher).__name__
            return BrokerUnavailableError(f"{name}: {reason}", event_id=event.id)

        try:
            return await client_call(call, self.settings.publish_timeout, failed)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - any publisher failure is classified
            return error


class _NotStarted(Exception):
    """A publish not started because the claim could run out before it ends."""


async def _all(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """``asyncio.gather`` of ``calls``, except that when one raises the others are cancelled
    and awaited before it propagates: a failed round leaves no publish running behind it,
    whose confirm nobody would settle."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stopping`` is set meanwhile."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)
