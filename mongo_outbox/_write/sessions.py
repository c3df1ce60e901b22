"""The caller's sessions while the outbox runs a transaction of its own on one.

A save given a session outside a transaction starts one on it (collection mode), and a save given
a session inside a transaction joins it. A session serves one task at a time (PyMongo's rule), so
a second save handed the same session meanwhile would join the first one's transaction: the first
one's refusal would then abort the second's writes behind a returned ``Saved``. Such a save is
refused instead.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mongo_outbox.errors import AggregateNotFoundError, DuplicateSequenceError, UsageError

# By id: a Motor session cannot be hashed. Weak values: a session gone is no longer busy, so its
# id, reused by another object, is not taken for it.
_busy: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_lock = threading.Lock()  # the sync API's threads share sessions as wrongly as tasks do


def check_free(session: Any) -> None:
    """UsageError if a save runs a transaction of its own on ``session`` now."""
    if _busy.get(id(session)) is session:
        raise UsageError(
            "this session is running another save's transaction: a session serves one task or "
            "thread at a time; give each concurrent save its own session (or none)"
        )


@contextmanager
def lent(session: Any) -> Iterator[None]:
    """While a save runs a transaction of its own on the caller's ``session``."""
    with _lock:
        check_free(session)
        _busy[id(session)] = session
    try:
        yield
    finally:
        _busy.pop(id(session), None)


def abandons(kind: str, error: BaseException) -> bool:
    """Whether a write that joined the caller's transaction and failed with ``error`` must
    abort it: interrupted mid-write (which of its writes happened is unknown), events that
    ``add_events`` could not add to the caller's own writes, or events refused for their
    sequences after the document was written (committed, either would be a change without its
    events)."""
    if not isinstance(error, Exception):
        return not isinstance(error, GeneratorExit)
    if isinstance(error, DuplicateSequenceError):
        return True
    return kind == "add" and isinstance(error, AggregateNotFoundError)
