"""``import mongo_outbox`` is the whole public surface, and nothing public leaks a private type."""

from __future__ import annotations

import importlib
import inspect

import pytest

import mongo_outbox
import mongo_outbox.publishers

EXTRA = {
    "AggregateNotFoundError",
    "BrokerFullError",
    "BrokerUnavailableError",
    "ChangeStreamError",
    "ChangeStreamRelay",
    "DeadLettered",
    "DuplicateSequenceError",
    "GroupStatus",
    "Guarded",
    "IncompatibleEventError",
    "Inbox",
    "InvalidCountersError",
    "Outcome",
    "RelayGroup",
    "RelayStatus",
    "Result",
    "RetryLater",
    "inbox_guard",
}
PUBLIC = {
    "Backoff",
    "ConcurrencyError",
    "ConfigurationError",
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
    "RelaySettings",
    "RelayStats",
    "Saved",
    "Upcasters",
    "UsageError",
    "new_event_id",
}


def test_all_is_exactly_the_public_surface() -> None:
    assert set(mongo_outbox.__all__) == PUBLIC | EXTRA
    for name in mongo_outbox.__all__:
        assert getattr(mongo_outbox, name) is not None
    assert set(mongo_outbox.publishers.__all__) == {
        "BatchPublisher",
        "FastStreamPublisher",
        "MemoryPublisher",
        "NatsPublisher",
        "Publisher",
        "RabbitMQPublisher",
        "RedisStreamsPublisher",
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


# Every import path users had before the package split: each must keep working.
IMPORT_PATHS = {
    "mongo_outbox.changestream": [
        "ChangeBatch",
        "ChangeSource",
        "ChangeStream",
        "ChangeStreamRelay",
        "RelayStatus",
        "WatchSource",
        "triage",
    ],
    "mongo_outbox.consumers": [
        "consume_nats",
        "consume_rabbitmq",
        "consume_redis",
        "handle_nats_message",
        "handle_rabbitmq_message",
    ],
    "mongo_outbox.errors": [
        "BrokerUnavailableError",
        "ChangeStreamError",
        "ConcurrencyError",
        "DuplicateEventError",
        "InboxError",
        "InvalidAggregateError",
        "InvalidEventError",
        "MessageIdentityError",
        "OutboxError",
        "PoisonMessage",
        "PublishError",
    ],
    "mongo_outbox.events": ["Event", "new_event_id", "utc_now"],
    "mongo_outbox.faststream": ["FastStreamHandler", "inbox_handler"],
    "mongo_outbox.inbox": [
        "DeadLettered",
        "Guarded",
        "Inbox",
        "Outcome",
        "Result",
        "RetryLater",
        "inbox_guard",
    ],
    "mongo_outbox.outbox": ["Outbox", "Saved"],
    # Each broker's adapter lives in mongo_outbox.brokers.<name>; the fronts below, and the
    # module paths of before, import it from there.
    "mongo_outbox.publishers": [
        "BatchPublisher",
        "FastStreamPublisher",
        "MemoryPublisher",
        "NatsPublisher",
        "Publisher",
        "RabbitMQPublisher",
        "RedisStreamsPublisher",
    ],
    "mongo_outbox.publishers.base": ["BatchPublisher", "Publisher"],
    "mongo_outbox.publishers.faststream": ["FastStreamPublisher"],
    "mongo_outbox.publishers.nats": ["NatsPublisher", "subject_of", "checked_subject"],
    "mongo_outbox.publishers.rabbitmq": ["RabbitMQPublisher", "routing_key_of"],
    "mongo_outbox.publishers.redis": ["RedisStreamsPublisher", "entry_of", "classify"],
    "mongo_outbox.consumers.nats": ["consume_nats", "handle_nats_message"],
    "mongo_outbox.consumers.rabbitmq": ["consume_rabbitmq", "handle_rabbitmq_message"],
    "mongo_outbox.consumers.redis": ["consume_redis", "default_consumer_name"],
    "mongo_outbox.backoff": ["Backoff"],
    "mongo_outbox.testing.emulator": ["CURSOR_NOT_FOUND", "server_error_code"],
    "mongo_outbox.publishers.memory": ["MemoryPublisher"],
    "mongo_outbox.relay": ["PollingRelay", "RelayStats"],
    "mongo_outbox.settings": ["Backoff", "RelaySettings"],
}


@pytest.mark.parametrize("module", sorted(IMPORT_PATHS))
def test_every_public_import_path_of_the_first_version_still_works(module: str) -> None:
    imported = importlib.import_module(module)
    for name in IMPORT_PATHS[module]:
        assert getattr(imported, name) is not None, f"{module}.{name}"


def test_the_sync_outbox_offers_every_write_of_the_async_one_without_await() -> None:
    import mongo_outbox.sync

    assert set(mongo_outbox.sync.__all__) == {"Outbox", "Saved"}
    assert mongo_outbox.sync.Saved is mongo_outbox.Saved
    writes = [
        "ensure_indexes",
        "save_with_events",
        "update_with_events",
        "delete_with_events",
        "add_events",
    ]
    for name in writes:
        async_write = getattr(mongo_outbox.Outbox, name)
        sync_write = getattr(mongo_outbox.sync.Outbox, name)
        assert inspect.iscoroutinefunction(async_write), name
        assert not inspect.iscoroutinefunction(sync_write), name
        assert inspect.signature(sync_write) == inspect.signature(async_write), name
    for function in (getattr(mongo_outbox.sync.Outbox, name) for name in writes):
        for annotation in inspect.get_annotations(function).values():
            assert "mongo_outbox._" not in str(annotation)


def test_each_lease_is_named_by_whose_it_is_and_each_setting_has_one_name() -> None:
    leases = {
        mongo_outbox.RelaySettings: "claim_lease",
        mongo_outbox.ChangeStreamRelay: "leader_lease",
        mongo_outbox.RelayGroup: "member_lease",
        mongo_outbox.Inbox: "processing_lease",
    }
    for owner, lease in leases.items():
        parameters = inspect.signature(owner).parameters
        assert lease in parameters and "lease" not in parameters, owner
    settings = mongo_outbox.RelaySettings()
    assert not hasattr(settings, "timeout") and not hasattr(settings, "lease")
    assert (settings.publish_timeout, settings.claim_lease) == (10.0, 30.0)


def test_the_cloudevents_front_is_its_all() -> None:
    import mongo_outbox.cloudevents

    assert set(mongo_outbox.cloudevents.__all__) == {
        "CONTENT_TYPE",
        "CloudEvents",
        "Received",
        "attributes_of",
        "read_binary",
        "read_cloudevent",
        "read_message",
        "read_structured",
        "structured_of",
    }
    for name in mongo_outbox.cloudevents.__all__:
        assert getattr(mongo_outbox.cloudevents, name) is not None


def test_the_admin_surface_is_public_typed_and_names_no_private_type() -> None:
    import dataclasses

    import mongo_outbox.admin

    assert set(mongo_outbox.admin.__all__) == {
        "SUMMARY",
        "Backlog",
        "Lease",
        "Member",
        "OutboxAdmin",
        "ParkedEntry",
        "ParkedPage",
        "Replayed",
    }
    records = ["Backlog", "Lease", "Member", "ParkedEntry", "ParkedPage"]
    for name in records:
        record = getattr(mongo_outbox.admin, name)
        assert dataclasses.is_dataclass(record) and record.__dataclass_params__.frozen, name
    for name in mongo_outbox.admin.__all__:
        obj = getattr(mongo_outbox.admin, name)
        assert not getattr(obj, "__module__", "mongo_outbox").startswith("mongo_outbox._"), name
        for _, member in inspect.getmembers(obj, inspect.isfunction):
            for annotation in inspect.get_annotations(member).values():
                assert "mongo_outbox._" not in str(annotation), (name, member, annotation)
