"""The words for what becomes of a message: ``Outcome``, ``Result`` and the ``DeadLetter`` a
message given up on goes to. A leaf, so that the guard, its attempts and the public ``inbox``
all speak them without importing each other."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mongo_outbox.events import Event

DeadLetter = Callable[[Event, str], Awaitable[None]]
"""``async dead_letter(event, reason)``: where a message given up on goes, e.g. a broker's DLQ."""


class Outcome(enum.Enum):
    """What became of one delivery of a message."""

    HANDLED = "handled"  # the handler ran and its effects are stored
    DUPLICATE = "duplicate"  # handled (or dead-lettered) before: skipped
    RETRY = "retry"  # failed for now, or another consumer holds it: deliver again after `delay`
    DEAD_LETTERED = "dead_lettered"  # given up on: recorded as failed and sent to the dead letter


@dataclass(frozen=True)
class Result:
    """The outcome, the attempt it was (0 when none ran), the delay before a retry, and why."""

    outcome: Outcome
    attempt: int = 0
    delay: float = 0.0
    error: str | None = None
