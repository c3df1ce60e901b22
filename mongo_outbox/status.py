"""What relays report about themselves: counters of their own work, the status an operator
reads, the one log line each change of state gets, and what a replay did."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal


@dataclass
class RelayCounters:
    """A relay's counters of its own work since it started (its ``stats``), kept in memory;
    ``RelayStatus`` is what an operator reads, from the outbox as well."""

    published: int = 0
    failed: int = 0
    parked: int = 0
    last_error: str | None = None
    errors_by_type: dict[str, int] = field(default_factory=dict)


RelayStats = RelayCounters
"""The name of before, beside ``RelayStatus`` one letter away (docs/architecture.md, Words)."""


State = Literal["starting", "standby", "active", "stopped", "failed"]


@dataclass
class RelayStatus:
    """What an operator needs to see. ``pending`` and the ages are read from the outbox;
    ``active`` is true exactly when ``state`` is ``"active"``."""

    name: str
    state: State
    active: bool
    last_checkpoint_at: datetime | None
    pending: int
    oldest_pending_age: timedelta | None
    parked: int
    publish_failures: int
    recoveries: int
    last_error: str | None


def transition(
    logger: logging.Logger, name: str, current: State, state: State, reason: str
) -> State:
    """Log a relay's change of state, one line with its reason (nothing when it stays put), and
    return the new state."""
    if state != current:
        level = logging.WARNING if state == "failed" else logging.INFO
        logger.log(level, "relay %s: %s -> %s (%s)", name, current, state, reason)
    return state


@dataclass
class GroupStatus:
    """A relay group member's view: ``owners`` maps each partition to the member holding its
    lease now (None: nobody, e.g. during a takeover), ``members`` each live member to the
    partitions its last heartbeat said it holds, ``owned`` this member's own partitions."""

    name: str
    member: str
    state: State
    partitions: int
    owned: tuple[int, ...]
    owners: dict[int, str | None]
    members: dict[str, tuple[int, ...]]
    pending: int
    published: int
    last_error: str | None


@dataclass
class Replayed:
    """What a replay (``OutboxAdmin.replay``, ``mongo-outbox replay``) found and sent."""

    found: int = 0
    published: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    """(event id, error) of each event the broker did not confirm."""
    skipped: int = 0
    """Events not sent because an earlier event of their aggregate failed."""
    aggregates: int = 0
    versions: Counter[tuple[str, int]] = field(default_factory=Counter)
    """How many of the events found are of each (type, version): what consumers will read."""
