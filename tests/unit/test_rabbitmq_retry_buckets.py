"""The retry queues' delay buckets: few, drawn from the guard's Backoff, and never shorter than
the delay they stand for (unless it is beyond the longest)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mongo_outbox import Backoff, ConfigurationError
from mongo_outbox.brokers.rabbitmq._retry_queues import (
    MAX_BUCKETS,
    RetryQueues,
    bucket_for,
    retry_buckets,
    retry_queue_name,
)


def test_the_default_backoff_has_a_bucket_per_doubling_up_to_its_maximum() -> None:
    assert retry_buckets(Backoff()) == (
        500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 256000, 300000,
    )  # fmt: skip


def test_a_constant_backoff_has_one_bucket() -> None:
    assert retry_buckets(Backoff(initial=3, maximum=3)) == (3000,)


def test_a_delay_goes_to_the_shortest_bucket_not_shorter_than_it() -> None:
    buckets = (500, 1000, 2000)
    assert [bucket_for(buckets, d) for d in (0.0, 0.5, 0.501, 1.9, 2.0, 9.0)] == [
        500, 500, 1000, 2000, 2000, 2000,
    ]  # fmt: skip


def test_retry_queue_names_follow_the_work_queue_but_not_into_amq() -> None:
    assert retry_queue_name("billing", 500) == "billing.retry.500"
    # "amq." names are the broker's: a server-named queue's retry queue drops the prefix.
    assert retry_queue_name("amq.gen-Xy1", 500) == "gen-Xy1.retry.500"


@given(
    initial=st.floats(min_value=1e-6, max_value=86400.0),
    span=st.floats(min_value=0.0, max_value=86400.0),
    factor=st.floats(min_value=1.0, max_value=100.0),
    attempt=st.integers(min_value=1, max_value=1000),
)
def test_buckets_are_few_and_cover_every_delay_of_the_backoff(
    initial: float, span: float, factor: float, attempt: int
) -> None:
    backoff = Backoff(initial=initial, maximum=initial + span, factor=factor)
    buckets = retry_buckets(backoff)
    assert 1 <= len(buckets) <= MAX_BUCKETS
    assert list(buckets) == sorted(set(buckets))
    assert buckets[-1] == math.ceil((initial + span) * 1000)
    assert buckets[0] == math.ceil(initial * 1000)
    delay = backoff.delay(attempt)
    assert bucket_for(buckets, delay) >= delay * 1000  # a retry never comes back early


def test_a_backoff_longer_than_rabbitmq_s_longest_ttl_is_refused_before_declaring() -> None:
    # RabbitMQ answered value_too_large, which was reported as a retry queue "with other
    # arguments" to delete.
    queue: Any = SimpleNamespace(name="orders", exclusive=False)  # FAKE: only its name is read
    with pytest.raises(ConfigurationError, match="longer than RabbitMQ's longest message TTL"):
        RetryQueues(queue, Backoff(initial=1, maximum=1e12))
    assert RetryQueues(queue, Backoff(initial=1, maximum=86_400)).buckets[-1] == 86_400_000
