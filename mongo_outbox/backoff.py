"""Exponential backoff with full jitter, shared by the relay and the inbox."""

from __future__ import annotations

import random
from dataclasses import dataclass

from mongo_outbox.errors import ConfigurationError
from mongo_outbox.settings import seconds


@dataclass(frozen=True)
class Backoff:
    """Delay before retry ``attempt`` (1 for the first retry): a random point in
    ``[0, min(maximum, initial * factor ** (attempt - 1))]``, so retries of many failed
    entries spread out instead of arriving together."""

    initial: float = 0.5
    maximum: float = 300.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        # Normalised once, so a timedelta works as well as seconds.
        object.__setattr__(self, "initial", seconds(self.initial, "Backoff.initial"))
        object.__setattr__(self, "maximum", seconds(self.maximum, "Backoff.maximum"))
        if self.initial > self.maximum:
            raise ConfigurationError(
                "Backoff.initial must not exceed Backoff.maximum", setting="Backoff.initial"
            )
        if isinstance(self.factor, bool) or not 1 <= self.factor < float("inf"):
            raise ConfigurationError(
                f"Backoff.factor must be a finite number >= 1, not {self.factor!r}",
                setting="Backoff.factor",
            )

    def delay(self, attempt: int) -> float:
        ceiling = min(self.maximum, self.initial * self.factor ** max(attempt - 1, 0))
        return random.uniform(0, ceiling)
