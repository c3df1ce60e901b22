"""Waiting for a condition with a deadline, instead of sleeping and hoping."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def until(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 10, every: float = 0.02
) -> None:
    """Return once ``condition()`` holds; fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"{getattr(condition, '__name__', condition)} still false")
        await asyncio.sleep(every)
