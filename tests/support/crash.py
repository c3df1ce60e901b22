"""What the crash processes and their tests share: dying on the spot, as a SIGKILL does, at
a chosen point, and the guarded billing handler the consumer crash tests run."""

from __future__ import annotations

import os
import signal
from typing import Any

from mongo_outbox import Event, Inbox, inbox_guard
from mongo_outbox.publishers import Publisher

CRASH_ON = 3  # the consumer process dies on the third message it sees


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAfter:
    """Publishes through ``inner``; once ``limit`` events are confirmed, dies on the spot."""

    def __init__(self, inner: Publisher, limit: int) -> None:
        self.inner = inner
        self.limit = limit
        self.confirmed = 0

    async def publish(self, event: Event) -> None:
        await self.inner.publish(event)
        self.confirmed += 1
        if self.confirmed >= self.limit:
            die()

    async def aclose(self) -> None:
        await self.inner.aclose()


class KillAfterWrite:
    """A collection that dies on the spot right after ``method`` wrote (the write is durable,
    the caller never hears back): a crash between that write and the caller's next step."""

    def __init__(self, inner: Any, method: str) -> None:
        self.inner = inner
        self.method = method

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name != self.method:
            return attribute

        async def write_then_die(*args: Any, **kwargs: Any) -> Any:
            await attribute(*args, **kwargs)
            die()

        return write_then_die


def billing(db: Any, transactional: bool, point: str) -> Any:
    seen = 0
    inbox = Inbox(db, consumer="billing", transactional=transactional, processing_lease=1.0)

    @inbox_guard(inbox)
    async def bill(event: Event, session: Any, *, attempt: int) -> None:
        nonlocal seen
        seen += 1
        if point == "before_write" and seen == CRASH_ON:
            die()
        # Idempotent on the event id, as a handler without transactions must be.
        await db.invoices.update_one(
            {"_id": event.id},
            {"$setOnInsert": {"attempt": attempt}},
            upsert=True,
            session=session,
        )
        if point == "after_write" and seen == CRASH_ON:
            die()

    return bill
