"""What differs between PyMongo's async API and Motor, in one place."""

from __future__ import annotations

import inspect
from typing import Any

DUPLICATE_KEY = 11000  # DuplicateKey, in a bulk write's writeErrors


async def start_session(client: Any) -> Any:
    """A new session of ``client``, to be used with ``async with``."""
    session = client.start_session()
    # Motor's start_session is a coroutine, PyMongo's returns the session.
    return await session if inspect.isawaitable(session) else session
