"""One vocabulary for settings: every duration is ``float`` seconds or a ``timedelta``, every
count a positive ``int``, each checked once where it enters, with a ``ConfigurationError`` that
names the setting.
"""

from __future__ import annotations

import math
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
