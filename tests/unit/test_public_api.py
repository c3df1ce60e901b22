"""``import mongo_outbox`` is the whole public surface, and nothing public leaks a private type."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from collections.abc import Iterator

import pytest

import mongo_outbox
import mongo_outbox.publishers
from mongo_outbox._moved import MOVED, advice

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
    "RelayCounters",
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
        "WavePublisher",
        "redact_url",
        "url_secrets",
    }
    for name in mongo_outbox.publishers.__all__:
        assert callable(getattr(mongo_outbox.publishers, name))


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
        "WavePublisher",
    ],
    "mongo_outbox.testing.emulator": ["CURSOR_NOT_FOUND", "server_error_code"],
    "mongo_outbox.relay": ["PollingRelay", "RelayCounters", "RelayStats"],
    "mongo_outbox.settings": ["Backoff", "RelaySettings"],
}


# The import paths of before that moved (mongo_outbox._moved.MOVED): each keeps working, with a
# DeprecationWarning, and gives the very objects of the new path.
OLD_PATHS = {
    "mongo_outbox.publishers.base": {
        "BatchPublisher": "mongo_outbox.brokers._publishing",
        "Publisher": "mongo_outbox.brokers._publishing",
        "redact_url": "mongo_outbox.brokers._publishing",
        "unavailable": "mongo_outbox.errors",
    },
    "mongo_outbox.publishers.faststream": {
        "FastStreamPublisher": "mongo_outbox.brokers.faststream.publisher"
    },
    "mongo_outbox.publishers.nats": {
        "NatsPublisher": "mongo_outbox.brokers.nats.publisher",
        "subject_of": "mongo_outbox.brokers.nats.publisher",
        "checked_subject": "mongo_outbox.brokers.nats.publisher",
    },
    "mongo_outbox.publishers.rabbitmq": {
        "RabbitMQPublisher": "mongo_outbox.brokers.rabbitmq.publisher",
        "routing_key_of": "mongo_outbox.brokers.rabbitmq.publisher",
    },
    "mongo_outbox.publishers.redis": {
        "RedisStreamsPublisher": "mongo_outbox.brokers.redis.publisher",
        "entry_of": "mongo_outbox.brokers.redis.publisher",
        "classify": "mongo_outbox.brokers.redis.errors",
    },
    "mongo_outbox.publishers.memory": {"MemoryPublisher": "mongo_outbox.brokers.memory.publisher"},
    "mongo_outbox.consumers.base": {
        "Delivery": "mongo_outbox.brokers._consuming",
        "decode": "mongo_outbox.brokers._consuming",
    },
    "mongo_outbox.consumers.nats": {
        "consume_nats": "mongo_outbox.brokers.nats.consumer",
        "handle_nats_message": "mongo_outbox.brokers.nats.consumer",
    },
    "mongo_outbox.consumers.rabbitmq": {
        "consume_rabbitmq": "mongo_outbox.brokers.rabbitmq.consumer",
        "handle_rabbitmq_message": "mongo_outbox.brokers.rabbitmq.consumer",
    },
    "mongo_outbox.consumers.redis": {
        "consume_redis": "mongo_outbox.brokers.redis.consumer",
        "default_consumer_name": "mongo_outbox.brokers.redis.consumer",
    },
    "mongo_outbox.changestream.checkpoint": {"LeaseLost": "mongo_outbox._relay.lease"},
    "mongo_outbox.backoff": {"Backoff": "mongo_outbox.settings"},
    "mongo_outbox.guard": {
        "inbox_guard": "mongo_outbox.inbox",
        "Guarded": "mongo_outbox.inbox",
        "check_message_id": "mongo_outbox.inbox",
    },
}


@pytest.mark.parametrize("module", sorted(IMPORT_PATHS))
def test_every_public_import_path_of_the_first_version_still_works(module: str) -> None:
    imported = importlib.import_module(module)
    for name in IMPORT_PATHS[module]:
        assert getattr(imported, name) is not None, f"{module}.{name}"


def forget(module: str) -> None:
    """Have the next import of ``module`` import it afresh (and warn again)."""
    sys.modules.pop(module, None)
    parent, _, name = module.rpartition(".")
    # Not hasattr: the package's __getattr__ would import the old submodule (and warn).
    vars(sys.modules[parent]).pop(name, None)


@pytest.fixture
def unimported(request: pytest.FixtureRequest) -> Iterator[str]:
    """The old path, imported afresh by the test (and forgotten again after it)."""
    module: str = request.param
    forget(module)
    yield module
    forget(module)


@pytest.mark.parametrize("unimported", sorted(OLD_PATHS), indirect=True)
def test_an_old_import_path_warns_and_gives_the_objects_of_the_new_one(unimported: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"^{unimported} is deprecated: ") as warned:
        imported = importlib.import_module(unimported)
    assert str(warned[0].message) == advice(unimported)
    for name, new in OLD_PATHS[unimported].items():
        assert getattr(imported, name) is getattr(importlib.import_module(new), name), name
    assert set(OLD_PATHS) == {path for path in MOVED if path.rpartition(".")[0] not in MOVED}


def test_an_old_path_s_renamed_names_are_the_new_objects() -> None:
    forget("mongo_outbox.changestream.checkpoint")
    with pytest.warns(DeprecationWarning, match="checkpoint is deprecated"):
        from mongo_outbox.changestream.checkpoint import Checkpoint  # type: ignore[attr-defined]
    from mongo_outbox._relay.lease import FencedLease

    assert Checkpoint is FencedLease
    forget("mongo_outbox.guard")
    with pytest.warns(DeprecationWarning, match="guard is deprecated"):
        from mongo_outbox import guard  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match=r"'mongo_outbox\.guard' has no attribute 'nothing'"):
        guard.nothing  # noqa: B018


def test_the_warning_names_a_public_path_and_never_a_private_one_as_the_one_to_use() -> None:
    assert advice("mongo_outbox.publishers.base") == (
        "mongo_outbox.publishers.base is deprecated: import from mongo_outbox.publishers "
        "instead (what that does not offer is internal now)"
    )
    assert advice("mongo_outbox.guard") == (
        "mongo_outbox.guard is deprecated: import from mongo_outbox.inbox instead"
    )
    assert advice("mongo_outbox.changestream.checkpoint") == (
        "mongo_outbox.changestream.checkpoint is deprecated: what it offered is internal now "
        "(mongo_outbox._relay.lease)"
    )


@pytest.mark.parametrize("unimported", sorted(OLD_PATHS), indirect=True)
def test_a_star_import_of_an_old_path_gives_what_it_gave(unimported: str) -> None:
    names: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match="is deprecated"):
        exec(f"from {unimported} import *", names)
    assert set(OLD_PATHS[unimported]) <= set(names)


def test_an_old_submodule_is_an_attribute_of_its_package_as_before() -> None:
    import mongo_outbox.publishers

    forget("mongo_outbox.publishers.memory")
    with pytest.warns(DeprecationWarning, match="publishers.memory is deprecated"):
        memory = mongo_outbox.publishers.memory  # type: ignore[attr-defined]
    assert memory.MemoryPublisher is mongo_outbox.publishers.MemoryPublisher
    assert "MemoryPublisher" in dir(memory)


def test_the_warning_points_at_the_line_that_imported_the_old_path() -> None:
    forget("mongo_outbox.backoff")
    with pytest.warns(DeprecationWarning, match="backoff is deprecated") as warned:
        import mongo_outbox.backoff  # noqa: F401
    assert warned[0].filename == __file__


def test_the_library_and_its_new_paths_import_without_a_deprecation_warning() -> None:
    names = [
        "mongo_outbox",
        "mongo_outbox.publishers",
        "mongo_outbox.consumers",
        "mongo_outbox.brokers",
        "mongo_outbox.cli.app",
        *sorted(IMPORT_PATHS),
    ]
    code = "".join(f"import {name}\n" for name in names)
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


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
        "Activity",
        "Backlog",
        "EventEntry",
        "Lease",
        "Member",
        "OutboxAdmin",
        "ParkedEntry",
        "ParkedPage",
        "Replayed",
    }
    records = ["Activity", "Backlog", "EventEntry", "Lease", "Member", "ParkedEntry", "ParkedPage"]
    for name in records:
        record = getattr(mongo_outbox.admin, name)
        assert dataclasses.is_dataclass(record) and record.__dataclass_params__.frozen, name
    for name in mongo_outbox.admin.__all__:
        obj = getattr(mongo_outbox.admin, name)
        assert not getattr(obj, "__module__", "mongo_outbox").startswith("mongo_outbox._"), name
        for _, member in inspect.getmembers(obj, inspect.isfunction):
            for annotation in inspect.get_annotations(member).values():
                assert "mongo_outbox._" not in str(annotation), (name, member, annotation)
