"""A client's call awaited for a bounded time: for connections that hang without a reset (a
stalled NAT or firewall, a half-open socket), which a client without a socket timeout would
wait on for ever."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(call: Awaitable[T], seconds: float) -> T:
    """``call``'s result; ``asyncio.TimeoutError`` once it took ``seconds`` (``call`` is then
    cancelled)."""
    if sys.version_info >= (3, 11):
        # Not wait_for: before 3.12 it could swallow a cancellation that came as the call
        # ended, and the caller would go on.
        async with asyncio.timeout(seconds):
            return await call
    return await asyncio.wait_for(call, seconds)
