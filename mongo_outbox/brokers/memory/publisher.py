"""MemoryPublisher: a real, in-process publisher for tests, demos and local runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mongo_outbox.brokers._publishing import closed_error
from mongo_outbox.events import Event


class MemoryPublisher:
    """Keeps every published event in ``events``, in publication order.

    Parameters:
        fail: optional ``fail(event) -> Exception | None``; a returned exception is raised
            instead of publishing, to rehearse broker failures.
    """

    def __init__(self, *, fail: Callable[[Event], BaseException | None] | None = None) -> None:
        self.events: list[Event] = []
        self.fail = fail
        self.closed = False
        self._changed = asyncio.Condition()

    async def publish(self, event: Event) -> None:
        if self.closed:
            raise closed_error(self, event)
        error = self.fail(event) if self.fail else None
        if error is not None:
            raise error
        self.events.append(event)
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, count: int, timeout: float = 10.0) -> list[Event]:
        """Wait until at least ``count`` events were published; return them."""
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: len(self.events) >= count), timeout
            )
        return self.events

    async def aclose(self) -> None:
        self.closed = True
