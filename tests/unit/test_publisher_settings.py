"""What the publishers share without a broker: how a URL is shown in logs and errors, and the
settings their constructors and ``connect`` check."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from mongo_outbox import ConfigurationError
from mongo_outbox.publishers import NatsPublisher, RabbitMQPublisher, redact_url, url_secrets


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://user:s3cret@host:4222", "nats://user:***@host:4222"),
        ("nats://t0ken@host:4222", "nats://***@host:4222"),
        ("amqp://guest:p@s/w?d@127.0.0.1:5672/vhost", "amqp://guest:***@127.0.0.1:5672/vhost"),
        ("amqp://guest:p%40ss@h/%2F?heartbeat=5", "amqp://guest:***@h/%2F?heartbeat=5"),
        ("amqp://guest:pa,ss@h/", "amqp://guest:***@h/"),
        (
            "nats://a:b@h1:4222, nats://t@h2:4222,nats://h3",
            "nats://a:***@h1:4222, nats://***@h2:4222,nats://h3",
        ),
        ("a:b@h1:4222,c:d@h2:4222", "a:***@h1:4222,c:***@h2:4222"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("", ""),
    ],
)
def test_redact_url_hides_passwords_and_tokens_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_url(shown) == shown


@pytest.mark.parametrize(
    ("url", "password"),
    [
        ("mongodb://app:Xk9&token=zq@db.example:27017/?authSource=admin", "Xk9&token=zq"),
        ("amqp://app:hunter2;pass=1@mq/vh", "hunter2;pass=1"),
    ],
)
def test_a_password_that_reads_like_a_query_parameter_is_hidden_whole(
    url: str, password: str
) -> None:
    # "&" and ";" may stand unescaped in a userinfo: no part of the password may show.
    shown = redact_url(url)
    assert not any(part in shown for part in ("Xk9", "hunter2", "zq", "pass=1")), shown
    assert password in url_secrets(url)


def test_redact_url_hides_too_much_rather_than_too_little() -> None:
    # An "@" after the host (in a path or query) is taken as the end of the credentials.
    assert redact_url("amqp://u:pw@host/vhost?name=a@b") == "amqp://u:***@b"
    assert redact_url("nats://a:b@h1,c:d@h2") == "nats://a:***@h2"


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "5", True, timedelta(0)])
def test_publishers_refuse_a_timeout_that_is_not_a_positive_duration(timeout: Any) -> None:
    for build in (
        lambda: NatsPublisher(None, timeout=timeout),  # type: ignore[arg-type]
        lambda: RabbitMQPublisher(None, timeout=timeout),  # type: ignore[arg-type]
    ):
        with pytest.raises(ConfigurationError) as error:
            build()
        assert error.value.setting.endswith(".timeout")


async def test_connect_refuses_a_bad_timeout_before_connecting() -> None:
    with pytest.raises(ConfigurationError, match=r"NatsPublisher\.timeout"):
        await NatsPublisher.connect("nats://127.0.0.1:1", timeout=0)
    with pytest.raises(ConfigurationError, match=r"RabbitMQPublisher\.timeout"):
        await RabbitMQPublisher.connect("amqp://guest:guest@127.0.0.1:1/", timeout=-2)


def test_publishers_take_a_timedelta_as_their_timeout() -> None:
    js: Any = None
    assert NatsPublisher(js, timeout=timedelta(milliseconds=1500)).timeout == 1.5
    assert RabbitMQPublisher(js, timeout=timedelta(seconds=2)).timeout == 2.0
    assert RabbitMQPublisher(js, timeout=3).timeout == 3.0
