"""The console's pure rules, without a server: what a shown text keeps of a credential, the
sign-in limit's buckets on a clock of the test's own, and the host names it answers to."""

from __future__ import annotations

import time

import pytest

from mongo_outbox.cli.console.hosts import allowed_hosts, is_loopback, name_of
from mongo_outbox.cli.console.limits import Rate, SignInLimit, client_key
from mongo_outbox.cli.console.redaction import redact_text, redacted
from mongo_outbox.errors import ConfigurationError


def test_every_url_in_a_text_loses_its_credentials() -> None:
    text = "failed: error.mongodb://u:pw1@h/x, then foo=redis://:pw2@r:6379 and nats://tok3@n"
    shown = redact_text(text)
    assert shown == (
        "failed: error.mongodb://u:***@h/x, then foo=redis://:***@r:6379 and nats://***@n"
    )
    assert redact_text("the token-is-here was refused", ["token-is-here"]) == (
        "the *** was refused"
    )


def test_data_is_redacted_through_and_keeps_its_numbers_and_keys() -> None:
    data = {"password": ["mongodb://a:b@c"], "n": 3, "none": None, "ok": True}
    assert redacted(data) == {"password": ["mongodb://a:***@c"], "n": 3, "none": None, "ok": True}


def test_a_long_word_is_redacted_in_linear_time() -> None:
    # Tried from every letter, the URL pattern took seconds for 50,000 letters (the square).
    started = time.perf_counter()
    redact_text("a" * 200_000)
    redact_text("a." * 100_000)
    assert time.perf_counter() - started < 2


class Clock:
    """A FAKE clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_client_gets_its_burst_then_one_guess_per_interval() -> None:
    clock = Clock()
    limit = SignInLimit(Rate(burst=2, every=10), Rate(burst=100, every=1), clock)
    assert [limit.take("10.0.0.1") for _ in range(3)] == [0, 0, pytest.approx(10)]
    assert limit.take("10.0.0.2") == 0  # another client
    clock.now += 5
    assert limit.take("10.0.0.1") == pytest.approx(5)
    clock.now += 5
    assert limit.take("10.0.0.1") == 0


def test_the_overall_limit_holds_whatever_the_address() -> None:
    clock = Clock()
    limit = SignInLimit(Rate(burst=5, every=10), Rate(burst=3, every=2), clock)
    assert [limit.take(f"10.0.0.{n}") for n in range(4)] == [0, 0, 0, pytest.approx(2)]
    clock.now += 2
    assert limit.take("10.0.0.9") == 0


def test_a_full_bucket_is_forgotten_and_ipv6_counts_by_its_64() -> None:
    clock = Clock()
    limit = SignInLimit(Rate(burst=1, every=10), Rate(burst=100, every=1), clock)
    assert limit.take("2001:db8::1") == 0
    assert limit.take("2001:db8::ffff") > 0  # the same /64
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1"
    clock.now += 10
    limit.take("10.0.0.1")
    assert set(limit.clients) == {"10.0.0.1"}


def test_the_host_names_answered_to() -> None:
    assert name_of("[::1]:8600") == "::1" and name_of("Console.Example.:443") == "console.example"
    assert name_of("[::1") is None
    assert allowed_hosts("0.0.0.0") == {"localhost", "127.0.0.1", "::1"}
    assert "10.1.2.3" in allowed_hosts("10.1.2.3")
    assert "proxy.example" in allowed_hosts("::", ["proxy.example:443"])
    with pytest.raises(ConfigurationError, match="not a host name"):
        allowed_hosts("127.0.0.1", ["[bad"])
    assert is_loopback("127.0.0.2") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
