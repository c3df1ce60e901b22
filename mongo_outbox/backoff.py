"""Exponential backoff with full jitter, shared by the relay and the inbox."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delay before retry ``attempt`` (1 for the first retry): a random point in
    ``[0, min(maximum, initial * factor ** (attempt - 1))]``, so retries of many failed
    entries spread out instead of arriving together."""

    initial: float = 0.5
    maximum: float = 300.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum or self.factor < 1:
            raise ValueError("Backoff needs 0 < initial <= maximum and factor >= 1")

    def delay(self, attempt: int) -> float:
        ceiling = min(self.maximum, self.initial * self.factor ** max(attempt - 1, 0))
        return random.uniform(0, ceiling)
