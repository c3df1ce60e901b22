"""One vocabulary for settings: every duration is ``float`` seconds or a ``timedelta``, every
count a positive ``int``, each checked once where it enters, with a ``ConfigurationError`` that
names the setting. The small values that group settings (``Backoff``, ``RelaySettings``) live here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import timedelta

from mongo_outbox.errors import ConfigurationError

Duration = float | int | timedelta

# The backoff's jitter draws from a generator of its own: drawing from ``random``'s shared one
# moved an application's seeded sequence on every retry (and, from the relay's thread, under a
# hypothesis test drawing on another).
_jitter = random.Random()
"""Seconds as a number, or a ``timedelta``."""


def check_seconds(
    value: Duration, setting: str, *, minimum: float = 0.0, zero: bool = False
) -> float:
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


def check_timedelta(value: Duration, setting: str) -> timedelta:
    """``check_seconds()``, as the ``timedelta`` that database timestamps are computed with."""
    return timedelta(seconds=check_seconds(value, setting))


def check_count(value: int, setting: str, *, minimum: int = 1) -> int:
    """A whole number ``>= minimum``; ``True`` and ``2.0`` are refused, not coerced."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(
            f"{setting} must be an int, not {type(value).__name__}", setting=setting
        )
    if value < minimum:
        raise ConfigurationError(f"{setting} must be >= {minimum}, not {value}", setting=setting)
    return value


def check_name(value: str, setting: str) -> str:
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
        object.__setattr__(self, "initial", check_seconds(self.initial, "Backoff.initial"))
        object.__setattr__(self, "maximum", check_seconds(self.maximum, "Backoff.maximum"))
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
        return _jitter.uniform(0, ceiling)


@dataclass(frozen=True, init=False)
class RelaySettings:
    """How a relay publishes; shared by ``PollingRelay``, ``ChangeStreamRelay`` and ``RelayGroup``.

    Parameters:
        batch_size: entries claimed per round.
        max_in_flight: messages awaiting the broker's confirmation at once.
        publish_timeout: how long one confirmation may take before it counts as failed.
        claim_lease: how long a round's claim holds; a relay that dies lets it run out, and
            another publishes its entries again. A round starts no new wave of publishes that
            could end after it, so two live relays never publish the same entry at once; it
            must be at least twice ``publish_timeout``.
        max_attempts: failed attempts after which an entry is parked (see
            ``parked()``); ``None`` retries for ever. Failures for want of a broker do not
            count (see docs/failures.md).
        backoff: delays between retries of a failed entry.

    Durations are given as seconds or timedeltas, and read back as seconds (``float``).
    """

    batch_size: int
    max_in_flight: int
    publish_timeout: float
    claim_lease: float
    max_attempts: int | None
    backoff: Backoff

    def __init__(
        self,
        batch_size: int = 100,
        max_in_flight: int = 256,
        publish_timeout: Duration = 10.0,
        claim_lease: Duration = 30.0,
        max_attempts: int | None = 10,
        backoff: Backoff = Backoff(),
    ) -> None:
        batch_size = check_count(batch_size, "RelaySettings.batch_size")
        max_in_flight = check_count(max_in_flight, "RelaySettings.max_in_flight")
        if max_attempts is not None:
            max_attempts = check_count(max_attempts, "RelaySettings.max_attempts")
        if not isinstance(backoff, Backoff):
            raise ConfigurationError(
                f"RelaySettings.backoff must be a Backoff, not {type(backoff).__name__}",
                setting="RelaySettings.backoff",
            )
        timeout = check_seconds(publish_timeout, "RelaySettings.publish_timeout")
        lease = check_seconds(claim_lease, "RelaySettings.claim_lease")
        if timeout * 2 > lease:
            raise ConfigurationError(
                f"RelaySettings.claim_lease ({lease:g} s) must be at least twice publish_timeout "
                f"({timeout:g} s): else a claim could run out while its publish may still succeed",
                setting="RelaySettings.claim_lease",
            )
        checked = {
            "batch_size": batch_size,
            "max_in_flight": max_in_flight,
            "publish_timeout": timeout,
            "claim_lease": lease,
            "max_attempts": max_attempts,
            "backoff": backoff,
        }
        # Frozen: set once here, so every reader gets checked values (durations in seconds).
        for field_name, value in checked.items():
            object.__setattr__(self, field_name, value)


def check_relay_settings(value: RelaySettings | None, setting: str) -> RelaySettings:
    """``value``, or the default ``RelaySettings()`` for ``None``."""
    if value is None:
        return RelaySettings()
    if not isinstance(value, RelaySettings):
        raise ConfigurationError(
            f"{setting} must be a RelaySettings, not {type(value).__name__}", setting=setting
        )
    return value
