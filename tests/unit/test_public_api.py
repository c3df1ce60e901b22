"""``import mongo_outbox`` is the whole public surface, and nothing public leaks a private type."""

from __future__ import annotations

import inspect

import mongo_outbox
import mongo_outbox.publishers

EXTRA = {
    "BrokerUnavailableError",
    "ChangeStreamError",
    "ChangeStreamRelay",
    "DeadLettered",
    "Guarded",
    "Inbox",
    "Outcome",
    "RelayStatus",
    "Result",
    "RetryLater",
    "inbox_guard",
}
PUBLIC = {
    "Backoff",
    "ConcurrencyError",
    "DuplicateEventError",
    "Event",
    "InboxError",
    "InvalidAggregateError",
    "InvalidEventError",
    "MessageIdentityError",
    "Outbox",
    "OutboxError",
    "PoisonMessage",
    "PollingRelay",
    "PublishError",
    "RelayStats",
    "Saved",
    "new_event_id",
}


def test_all_is_exactly_the_public_surface() -> None:
    assert set(mongo_outbox.__all__) == PUBLIC | EXTRA
    for name in mongo_outbox.__all__:
        assert getattr(mongo_outbox, name) is not None
    assert set(mongo_outbox.publishers.__all__) == {
        "BatchPublisher",
        "MemoryPublisher",
        "NatsPublisher",
        "Publisher",
        "RabbitMQPublisher",
    }
    for name in mongo_outbox.publishers.__all__:
        assert inspect.isclass(getattr(mongo_outbox.publishers, name))


def test_errors_share_one_root() -> None:
    errors = [
        getattr(mongo_outbox, n) for n in mongo_outbox.__all__ if n.endswith(("Error", "Message"))
    ]
    assert errors and all(issubclass(e, mongo_outbox.OutboxError) for e in errors)


def test_no_public_signature_mentions_a_private_module() -> None:
    for name in mongo_outbox.__all__:
        obj = getattr(mongo_outbox, name)
        functions = (
            [obj]
            if inspect.isfunction(obj)
            else [
                member
                for _, member in inspect.getmembers(obj, inspect.isfunction)
                if not member.__name__.startswith("_") or member.__name__ == "__init__"
            ]
        )
        for function in functions:
            for annotation in inspect.get_annotations(function).values():
                assert "mongo_outbox._" not in str(annotation), (name, function, annotation)
