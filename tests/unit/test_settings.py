"""Every duration and count a constructor takes is checked where it enters: a zero or negative
interval would busy-loop, a NaN would never fire, a bool is no count."""

from __future__ import annotations

import math
import random
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from mongo_outbox import (
    Backoff,
    ChangeStreamRelay,
    ConfigurationError,
    Outbox,
    PollingRelay,
    RelaySettings,
)
from mongo_outbox.publishers import MemoryPublisher

BAD_DURATIONS = [0, -1, -0.5, math.nan, math.inf, timedelta(0), timedelta(seconds=-3), "5", None]
BAD_COUNTS = [0, -1, 2.0, True, "3", None]


def outbox() -> Outbox:
    return Outbox(AsyncMongoClient[Any](connect=False).shop)


def relay_with(**options: Any) -> Any:
    return PollingRelay(outbox(), MemoryPublisher(), **options)


def change_relay_with(**options: Any) -> Any:
    return ChangeStreamRelay(outbox(), MemoryPublisher(), name="r", **options)


CONSTRUCTORS = {
    "PollingRelay.interval": lambda v: relay_with(interval=v),
    "ChangeStreamRelay.max_wait": lambda v: change_relay_with(max_wait=v),
    "ChangeStreamRelay.leader_lease": lambda v: change_relay_with(leader_lease=v),
    "ChangeStreamRelay.sweep_interval": lambda v: change_relay_with(sweep_interval=v),
    "RelaySettings.publish_timeout": lambda v: RelaySettings(publish_timeout=v),
    "RelaySettings.claim_lease": lambda v: RelaySettings(claim_lease=v),
    "Backoff.initial": lambda v: Backoff(initial=v),
    "Backoff.maximum": lambda v: Backoff(maximum=v),
}
COUNTS = {
    "RelaySettings.batch_size": lambda v: RelaySettings(batch_size=v),
    "RelaySettings.max_in_flight": lambda v: RelaySettings(max_in_flight=v),
    "RelaySettings.max_attempts": lambda v: RelaySettings(max_attempts=v),
}


@pytest.mark.parametrize("setting", sorted(CONSTRUCTORS))
@pytest.mark.parametrize("value", BAD_DURATIONS, ids=repr)
def test_a_bad_duration_is_refused_with_the_setting_named(setting: str, value: Any) -> None:
    if setting == "Backoff.maximum" and value is math.inf:
        pass  # still refused: an infinite backoff would never retry
    with pytest.raises(ConfigurationError) as raised:
        CONSTRUCTORS[setting](value)
    assert raised.value.setting == setting


@pytest.mark.parametrize("setting", sorted(COUNTS))
@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
def test_a_bad_count_is_refused_with_the_setting_named(setting: str, value: Any) -> None:
    if setting == "RelaySettings.max_attempts" and value is None:
        return  # None means: retry for ever
    with pytest.raises(ConfigurationError) as raised:
        COUNTS[setting](value)
    assert raised.value.setting == setting


def test_durations_take_seconds_or_timedeltas_alike() -> None:
    assert RelaySettings(publish_timeout=timedelta(seconds=2), claim_lease=4).publish_timeout == 2.0
    assert Backoff(initial=timedelta(milliseconds=250)).initial == 0.25
    assert change_relay_with(leader_lease=timedelta(seconds=3)).leader_lease == timedelta(seconds=3)


def test_a_claim_lease_shorter_than_two_publish_timeouts_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="at least twice publish_timeout") as raised:
        RelaySettings(publish_timeout=5, claim_lease=8)
    assert raised.value.setting == "RelaySettings.claim_lease"


@pytest.mark.parametrize(
    "backoff",
    [
        lambda: Backoff(initial=5, maximum=1),
        lambda: Backoff(factor=0.5),
        lambda: Backoff(factor=math.nan),
        lambda: Backoff(factor=True),
    ],
)
def test_an_inconsistent_backoff_is_refused(backoff: Any) -> None:
    with pytest.raises(ConfigurationError):
        backoff()


def test_a_backoff_never_overflows_however_many_attempts() -> None:
    assert 0 <= Backoff(initial=1, maximum=60, factor=10).delay(100_000) <= 60


def test_a_relay_name_must_be_a_non_empty_string() -> None:
    for name in ("", None, 7):
        with pytest.raises(ConfigurationError):
            ChangeStreamRelay(outbox(), MemoryPublisher(), name=name)  # type: ignore[arg-type]
    for name in ("", None, 7, "a\x00b"):
        with pytest.raises(ConfigurationError):
            PollingRelay(outbox(), MemoryPublisher(), name=name)  # type: ignore[arg-type]


def test_the_backoffs_jitter_leaves_the_shared_random_generator_alone() -> None:
    # An application's seeded ``random`` sequence must not move with the relay's retries (a
    # hypothesis test drawing on another thread saw it move, and failed as flaky).
    backoff = Backoff(initial=1, maximum=8)
    random.seed(7)
    before = random.getstate()
    delays = [backoff.delay(attempt) for attempt in range(1, 50)]
    assert random.getstate() == before
    assert all(0 <= d <= 8 for d in delays) and len(set(delays)) > 1  # still jittered
