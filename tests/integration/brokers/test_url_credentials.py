"""A credential in a broker URL's query string never reaches an error: the publishers show
every URL through ``redact_url``."""

from __future__ import annotations

import pytest

from mongo_outbox.brokers.redis.publisher import RedisStreamsPublisher


async def test_a_redis_password_in_the_query_is_not_in_the_connection_error() -> None:
    url = "redis://127.0.0.1:1/0?password=wr0ng-passw0rd"  # nothing listens on port 1

    with pytest.raises(ConnectionError) as raised:
        await RedisStreamsPublisher.connect(url, timeout=2)

    assert "password=***" in str(raised.value)
    assert "wr0ng-passw0rd" not in str(raised.value)
