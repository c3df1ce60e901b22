"""Whether a callable given to us is a coroutine function, asked once for publishers, handlers
and dead letters alike: a plain ``def`` would run its side effect, then fail when awaited, and
be retried, so it is refused before anything runs."""

from __future__ import annotations

import functools
import inspect


def is_async_callable(function: object) -> bool:
    """Whether calling ``function`` returns a coroutine: an ``async def`` function or method, a
    ``functools.partial`` of one, or an object (not a class) whose ``__call__`` is one."""
    while isinstance(function, functools.partial):
        function = function.func
    if inspect.iscoroutinefunction(function):
        return True
    if inspect.isclass(function) or inspect.isroutine(function):
        return False
    call = getattr(function, "__call__", None)  # noqa: B004 - the method itself is inspected
    return call is not None and inspect.iscoroutinefunction(call)
