"""What relays report about themselves: counters of their own work, and the status an
operator reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal


@dataclass
class RelayStats:
    published: int = 0
    failed: int = 0
    parked: int = 0
    last_error: str | None = None
    errors_by_type: dict[str, int] = field(default_factory=dict)


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
