"""The faststream extra stays optional: nothing imports FastStream until its modules are asked
for, and they name the extra when it is missing. inbox_handler checks its settings before any
message arrives."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from mongo_outbox import ConfigurationError, Event, Inbox


def run(code: str) -> subprocess.CompletedProcess[str]:
    # A process of its own: this one has imported FastStream already.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_importing_the_library_and_its_publishers_imports_no_faststream() -> None:
    result = run(
        "import sys, mongo_outbox, mongo_outbox.publishers, mongo_outbox.consumers\n"
        "assert 'faststream' not in sys.modules, sorted(sys.modules)\n"
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "statement",
    [
        "from mongo_outbox.faststream import inbox_handler",
        "from mongo_outbox.publishers import FastStreamPublisher",
    ],
)
def test_a_missing_faststream_names_its_extra(statement: str) -> None:
    result = run(
        f"import sys\nsys.modules['faststream'] = None  # as if not installed\n{statement}"
    )
    assert result.returncode == 1
    assert "ImportError" in result.stderr and "mongo-outbox[faststream]" in result.stderr


async def handler(event: Event, session: Any) -> None:
    pass


def test_inbox_handler_refuses_bad_settings_before_any_message(db: Any) -> None:
    from mongo_outbox.faststream import inbox_handler

    inbox = Inbox(db, consumer="billing")
    with pytest.raises(ConfigurationError, match="pydantic model class"):
        inbox_handler(inbox, payload=dict)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="source"):
        inbox_handler(inbox, source="x" * 600)
    with pytest.raises(ConfigurationError, match="delivery_limit"):
        inbox_handler(inbox, delivery_limit=-1)
    with pytest.raises(TypeError, match="async function"):
        inbox_handler(inbox)(lambda event, session: None)


async def test_a_message_of_another_broker_is_refused(db: Any) -> None:
    """A Redis (or batch) message has no identity the handler knows how to read."""
    from faststream.message import StreamMessage

    from mongo_outbox.faststream import inbox_handler

    subscriber: Any = inbox_handler(Inbox(db, consumer="billing"))(handler)
    message = StreamMessage(raw_message={"data": b"{}"}, body=b"{}")
    with pytest.raises(ConfigurationError, match="RabbitMQ and NATS JetStream"):
        await subscriber.inbox.handle(message)


def test_every_redis_error_is_classified_alike_through_faststream_and_the_redis_publisher() -> None:
    """One classification of Redis errors serves both paths: what RedisStreamsPublisher waits
    on (a failover, a persistence failure, a full server), FastStream's path waits on too."""
    from redis import exceptions

    from mongo_outbox.brokers.faststream.errors import classifier
    from mongo_outbox.brokers.redis.errors import classify

    errors = [
        exceptions.ReadOnlyError("You can't write against a read only replica."),
        exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"),
        exceptions.NoPermissionError("NOPERM this user has no permissions"),
        exceptions.BusyLoadingError("LOADING Redis is loading the dataset in memory"),
        exceptions.OutOfMemoryError("OOM command not allowed"),
        *(
            exceptions.ResponseError(f"{prefix} something")
            for prefix in ("MISCONF", "LOADING", "MASTERDOWN", "TRYAGAIN", "NOREPLICAS")
        ),
        exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"),
        exceptions.ConnectionError("Connection refused"),
    ]
    event = Event(type="order.placed")
    through_faststream = classifier("Redis")
    for error in errors:
        mine, theirs = classify(error, event, "events"), through_faststream(error, event, "events")
        assert mine is not None, error
        assert (type(theirs), str(theirs)) == (type(mine), str(mine)), error
    # The event's own failure counts an attempt on both paths.
    assert classify(exceptions.ResponseError("ERR syntax"), event, "s") is None
    assert through_faststream(exceptions.ResponseError("ERR syntax"), event, "s") is None
