"""Waiting for a condition with a deadline, instead of sleeping and hoping."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from mongo_outbox import BrokerUnavailableError


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10,
    every: float = 0.02,
    explain: Callable[[], Awaitable[str]] | None = None,
) -> None:
    """Return once ``condition()`` holds; fail the test after ``timeout`` seconds, with what
    ``explain()`` says of the state then, if given."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            told = f":\n{await explain()}" if explain is not None else ""
            raise AssertionError(f"{getattr(condition, '__name__', condition)} still false{told}")
        await asyncio.sleep(every)


async def drained(
    left: Callable[[], Awaitable[int]],
    stalled: float = 20,
    every: float = 0.05,
    explain: Callable[[], Awaitable[str]] | None = None,
) -> None:
    """Return once ``left()`` is 0; fail the test once it has not gone down for ``stalled``
    seconds. A backlog drains at the machine's pace: a fixed deadline fails a loaded machine
    that is making progress, where a stall is what a lost or stuck entry looks like."""
    loop = asyncio.get_running_loop()
    fewest, since = await left(), loop.time()
    while fewest:
        await asyncio.sleep(every)
        now = await left()
        if now < fewest:
            fewest, since = now, loop.time()
        elif loop.time() - since > stalled:
            told = f":\n{await explain()}" if explain is not None else ""
            raise AssertionError(f"{now} left, none less for {stalled:g} s{told}")


async def progressing(
    work: Awaitable[Any], progress: Callable[[], int], stalled: float = 30, every: float = 0.1
) -> Any:
    """``work``'s result; fail the test (``work`` cancelled) once ``progress()`` has not grown
    for ``stalled`` seconds. ``drained``'s rule for work that counts up: a loaded machine that
    is slow but moving passes, a stuck writer or relay fails after the stall, not at a fixed
    deadline."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    most, since = progress(), loop.time()
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=every)
            now = progress()
            if now > most:
                most, since = now, loop.time()
            elif not task.done() and loop.time() - since > stalled:
                raise AssertionError(f"no progress past {most} for {stalled:g} s")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def eventually(attempt: Callable[[], Awaitable[Any]], seconds: float = 30) -> Any:
    """``attempt()``'s result once it stops raising a broker outage; fails after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await attempt()
        except BrokerUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


class LoopStalls:
    """The longest time this event loop took to run a task due every 50 ms, while watching: a
    loop held up (by an in-process emulator's CPU work on a loaded machine) delays every timer on
    it, leases included, and says why a wait ran out."""

    def __init__(self) -> None:
        self.longest = 0.0

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + 0.05
            await asyncio.sleep(0.05)
            self.longest = max(self.longest, loop.time() - due)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        watcher = asyncio.ensure_future(self._watch())
        try:
            yield
        finally:
            watcher.cancel()


def awaiting(task: asyncio.Task[Any]) -> str:
    """Where ``task`` waits: its chain of coroutines, one line each, down to what the last one
    awaits (``Task.print_stack`` shows only the outermost)."""
    lines = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            where = frame.f_code.co_filename.rsplit("site-packages/", 1)[-1]
            lines.append(f"  {where}:{frame.f_lineno} {frame.f_code.co_name}")
        inner = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if inner is None:
            lines.append(f"  awaiting {coro!r}")
        coro = inner
    return "\n".join(lines)
