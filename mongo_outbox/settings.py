"""One vocabulary for settings: every duration is ``float`` seconds or a ``timedelta``, every
count a positive ``int``, each checked once where it enters, with a ``ConfigurationError`` that
names the setting. The small values that group settings (``Backoff``, ``RelaySettings``) live here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from datetime import timedelta

from mongo_outbox.errors import ConfigurationError

Duration = float | int | timedelta
"""Seconds as a number, or a ``timedelta``."""


def seconds(value: Duration, setting: str, *, minimum: float = 0.0, zero: bool = False) -> float:
    """``value`` in seconds, refused unless finite and above ``minimum`` (or equal to it when
    ``zero`` allows it): a zero or negative interval would busy-loop."""
    if isinstance(value, timedelta):
        number = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ConfigurationError(
            f"{setting} must be seconds (a number) or a timedelta, not {type(value).__name__}",
            setting=setting,
        )
    if not math.isfinite(number) or number < minimum or (number == minimum and not zero):
        bound = f">= {minimum:g}" if zero else f"> {minimum:g}"
        raise ConfigurationError(
            f"{setting} must be a finite duration {bound} s, not {value!r}", setting=setting
        )
    return number


def interval(value: Duration, setting: str) -> timedelta:
    """``seconds()``, as the ``timedelta`` that database timestamps are computed with."""
    return timedelta(seconds=seconds(value, setting))


def count(value: int, setting: str, *, minimum: int = 1) -> int:
    """A whole number ``>= minimum``; ``True`` and ``2.0`` are refused, not coerced."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(
            f"{setting} must be an int, not {type(value).__name__}", setting=setting
        )
    if value < minimum:
        raise ConfigurationError(f"{setting} must be >= {minimum}, not {value}", setting=setting)
    return value


def name(value: str, setting: str) -> str:
    """A non-empty ``str`` without NUL: a name that MongoDB stores and logs show."""
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ConfigurationError(
            f"{setting} must be a non-empty str, not {value!r}", setting=setting
        )
    return value


@dataclass(frozen=True)
class Backoff:
    """Delay before retry ``attempt`` (1 for the first retry): a random point in
    ``[0, min(maximum, initial * factor ** (attempt - 1))]``, so retries of many failed
    entries spread out instead of arriving together. Durations are seconds or timedeltas."""

    initial: Duration = 0.5
    maximum: Duration = 300.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        # Normalised once, so a timedelta works as well as seconds.
        object.__setattr__(self, "initial", seconds(self.initial, "Backoff.initial"))
        object.__setattr__(self, "maximum", seconds(self.maximum, "Backoff.maximum"))
        if self.initial > self.maximum:  # type: ignore[operator]
            raise ConfigurationError(
                "Backoff.initial must not exceed Backoff.maximum", setting="Backoff.initial"
            )
        if isinstance(self.factor, bool) or not 1 <= self.factor < math.inf:
            raise ConfigurationError(
                f"Backoff.factor must be a finite number >= 1, not {self.factor!r}",
                setting="Backoff.factor",
            )

    def delay(self, attempt: int) -> float:
        initial, maximum = float(self.initial), float(self.maximum)  # type: ignore[arg-type]
        ceiling = initial
        if attempt > 1 and self.factor > 1:
            # Compared in logarithms: factor ** attempts overflows long before attempts end.
            if attempt - 1 >= math.log(maximum / initial, self.factor):
                ceiling = maximum
            else:
                ceiling = min(maximum, initial * float(self.factor) ** (attempt - 1))
        return random.uniform(0, ceiling)


@dataclass(frozen=True)
class RelaySettings:
    """How a relay publishes; shared by ``PollingRelay`` and ``ChangeStreamRelay``.

    Parameters:
        batch_size: entries claimed per round.
        max_in_flight: messages awaiting the broker's confirmation at once.
        publish_timeout: how long one confirmation may take before it counts as failed.
        claim_lease: how long a round's claim holds; a relay that dies lets it run out, and
            another publishes its entries again. A round starts no new wave of publishes that
            could end after it, so two live relays never publish the same entry at once; it
            must be at least twice ``publish_timeout``.
        max_attempts: failed attempts after which an entry is parked as dead-lettered (see
            ``parked()``); ``None`` retries for ever. Failures for want of a broker do not
            count (see docs/failures.md).
        backoff: delays between retries of a failed entry.
    """

    batch_size: int = 100
    max_in_flight: int = 256
    publish_timeout: Duration = 10.0
    claim_lease: Duration = 30.0
    max_attempts: int | None = 10
    backoff: Backoff = field(default_factory=Backoff)

    def __post_init__(self) -> None:
        count(self.batch_size, "RelaySettings.batch_size")
        count(self.max_in_flight, "RelaySettings.max_in_flight")
        if self.max_attempts is not None:
            count(self.max_attempts, "RelaySettings.max_attempts")
        if not isinstance(self.backoff, Backoff):
            raise ConfigurationError(
                f"RelaySettings.backoff must be a Backoff, not {type(self.backoff).__name__}",
                setting="RelaySettings.backoff",
            )
        timeout = seconds(self.publish_timeout, "RelaySettings.publish_timeout")
        lease = seconds(self.claim_lease, "RelaySettings.claim_lease")
        if timeout * 2 > lease:
            raise ConfigurationError(
                f"RelaySettings.claim_lease ({lease:g} s) must be at least twice publish_timeout "
                f"({timeout:g} s): else a claim could run out while its publish may still succeed",
                setting="RelaySettings.claim_lease",
            )
        object.__setattr__(self, "publish_timeout", timeout)
        object.__setattr__(self, "claim_lease", lease)

    @property
    def timeout(self) -> float:
        return float(self.publish_timeout)  # type: ignore[arg-type]

    @property
    def lease(self) -> timedelta:
        return timedelta(seconds=float(self.claim_lease))  # type: ignore[arg-type]
