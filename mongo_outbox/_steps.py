"""One implementation of the write rules for PyMongo's async and sync APIs.

The write side is written once, as generators that ``yield`` each database call they need (a
``Call``: which collection, which method, which arguments) and receive its result back, or its
exception thrown in at the ``yield``. The control flow (retry a refused upsert, explain why an
update matched nothing, release event-id reservations after a refusal) lives in those
generators; ``run_async`` and ``run_sync`` only perform the calls, awaiting them or not. So
``mongo_outbox.Outbox`` and ``mongo_outbox.sync.Outbox`` cannot drift apart: they run the same
steps. It lies beside ``_driver`` rather than in ``_write``: the partition count's check
(``_partitions``), which a relay group runs too, is written as steps as well.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """``target.method(*args, **kwargs)``; ``listed``: the method returns a cursor, read whole."""

    target: Any
    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    listed: bool = False


Steps = Generator[Call, Any, T]
"""A write as a generator of the calls it makes, returning its result."""


def call(target: Any, method: str, *args: Any, **kwargs: Any) -> Call:
    return Call(target, method, args, kwargs)


def listing(target: Any, method: str, *args: Any, **kwargs: Any) -> Call:
    return Call(target, method, args, kwargs, listed=True)


async def run_async(steps: Steps[T]) -> T:
    """Perform ``steps`` with an async client (PyMongo's async API or Motor)."""
    reply: Any = None
    failure: Exception | None = None
    while True:
        try:
            step = steps.send(reply) if failure is None else steps.throw(failure)
        except StopIteration as done:
            result: T = done.value
            return result
        reply, failure = None, None
        try:
            made = getattr(step.target, step.method)(*step.args, **step.kwargs)
            if step.listed:
                # PyMongo's async aggregate() is a coroutine that gives the cursor; find() is not.
                cursor = await made if inspect.isawaitable(made) else made
                reply = await cursor.to_list(None)
            elif inspect.isawaitable(made):
                reply = await made
            else:
                reply = made
        except Exception as error:  # noqa: BLE001 - handed to the steps, which decide
            failure = error
        except BaseException:
            # A cancellation: the steps' cleanup runs now, not when the generator is collected
            # (by then a retry of the same write may have set what it would undo).
            steps.close()
            raise


def run_sync(steps: Steps[T]) -> T:
    """Perform ``steps`` with PyMongo's sync client."""
    reply: Any = None
    failure: Exception | None = None
    while True:
        try:
            step = steps.send(reply) if failure is None else steps.throw(failure)
        except StopIteration as done:
            result: T = done.value
            return result
        reply, failure = None, None
        try:
            made = getattr(step.target, step.method)(*step.args, **step.kwargs)
            reply = list(made) if step.listed else made
        except Exception as error:  # noqa: BLE001 - handed to the steps, which decide
            failure = error
        except BaseException:  # KeyboardInterrupt, say: clean up now, as run_async does
            steps.close()
            raise
