"""Fakes for driving relays step by step in a model-based test: a broker that checks every
publication before it confirms it, a switch that kills a relay right after a confirm, and a
change source that hands the relay one batch at a time and says when it has handled it; and a
broker that confirms slowly, for the lease tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from mongo_outbox import Event
from mongo_outbox.changestream import ChangeBatch
from mongo_outbox.publishers import MemoryPublisher


class CheckingBroker(MemoryPublisher):
    """FAKE broker. ``fail(event)`` returns the error a publish raises, or ``None``; a publish
    that does not fail awaits ``check(event)``, which returns what is wrong with publishing the
    event now, then confirms. Records every attempt (``attempts``, cleared by the caller) and
    everything found wrong (``violations``), also two events of one aggregate in flight."""

    def __init__(
        self,
        fail: Callable[[Event], BaseException | None],
        check: Callable[[Event], Awaitable[list[str]]],
    ) -> None:
        super().__init__(fail=fail)
        self.check = check
        self.attempts: list[tuple[str, BaseException | None]] = []
        self.violations: list[str] = []
        self.in_flight: set[Any] = set()

    async def publish(self, event: Event) -> None:
        key = event.aggregate_id
        if key in self.in_flight:
            self.violations.append(f"two events of aggregate {key} in flight ({event.id})")
        self.in_flight.add(key)
        try:
            error = self.fail(event) if self.fail else None
            self.attempts.append((event.id, error))
            if error is not None:
                raise error
            self.violations += await self.check(event)
            self.events.append(event)
        finally:
            self.in_flight.discard(key)


class KillSwitch:
    """Publishes into ``inner``; right after the ``after``-th confirm it cancels ``task``: the
    relay process dies between the broker's confirm and its settle."""

    def __init__(self, inner: MemoryPublisher, after: int) -> None:
        self.inner = inner
        self.after = after
        self.confirmed = 0
        self.task: asyncio.Future[Any] | None = None

    @property
    def fired(self) -> bool:
        return self.confirmed >= self.after

    async def publish(self, event: Event) -> None:
        await self.inner.publish(event)
        self.confirmed += 1
        if self.confirmed == self.after and self.task is not None:
            self.task.cancel()

    async def aclose(self) -> None:
        pass


class GatedSource:
    """FAKE change source, and its one stream: ``deliver(batch)`` hands the relay one batch and
    returns once the relay asks for the next, i.e. has done all that batch made it do. Between
    deliveries a relay with a ``max_wait`` longer than the test does nothing at all."""

    def __init__(self) -> None:
        self.batches: asyncio.Queue[ChangeBatch] = asyncio.Queue()
        self.idle = asyncio.Event()

    async def open(self, *, resume_after: Any = None, start_at: Any = None) -> GatedSource:
        return self

    async def cluster_time(self) -> Any:
        return None  # the relay then opens the stream first and sweeps after

    async def next_batch(self, max_size: int, max_wait: float) -> ChangeBatch:
        if self.batches.empty():
            self.idle.set()
        try:
            batch = await asyncio.wait_for(self.batches.get(), max_wait)
        except asyncio.TimeoutError:
            return ChangeBatch([], None)
        self.idle.clear()
        return batch

    async def aclose(self) -> None:
        pass

    async def wait_idle(self, relay_task: asyncio.Future[Any], timeout: float = 30) -> None:
        """Return once the relay waits for a batch; raise what it died of, if it did."""
        idle = asyncio.ensure_future(self.idle.wait())
        try:
            await asyncio.wait({idle, relay_task}, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            idle.cancel()
        if relay_task.done():
            relay_task.result()
            raise AssertionError("the change-stream relay stopped")
        if not self.idle.is_set():
            raise AssertionError(f"the change-stream relay is still busy after {timeout} s")

    async def deliver(self, batch: ChangeBatch, relay_task: asyncio.Future[Any]) -> None:
        self.idle.clear()
        self.batches.put_nowait(batch)
        await self.wait_idle(relay_task)


class SlowBroker(MemoryPublisher):
    """FAKE broker whose every confirm takes ``delay`` seconds: a slow broker on demand."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def publish(self, event: Event) -> None:
        await asyncio.sleep(self.delay)
        await super().publish(event)
