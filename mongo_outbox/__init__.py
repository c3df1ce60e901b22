"""mongo-outbox: reliable event publishing from MongoDB.

Write an aggregate and its events atomically (``Outbox.save_with_events``, ``update_with_events``,
``delete_with_events``, ``add_events``; ``mongo_outbox.sync.Outbox`` for PyMongo's sync client),
relay them to a broker at least once and in order per aggregate (``PollingRelay``), and consume
them effectively once.
"""

from mongo_outbox import _moved
from mongo_outbox.changestream import ChangeStreamRelay, RelayStatus
from mongo_outbox.errors import (
    AggregateNotFoundError,
    BrokerFullError,
    BrokerUnavailableError,
    ChangeStreamError,
    ConcurrencyError,
    ConfigurationError,
    DeadLettered,
    DuplicateEventError,
    DuplicateSequenceError,
    InboxError,
    IncompatibleEventError,
    InvalidAggregateError,
    InvalidCountersError,
    InvalidEventError,
    MessageIdentityError,
    OutboxError,
    PoisonMessage,
    PublishError,
    RetryLater,
    UsageError,
)
from mongo_outbox.events import Event, new_event_id
from mongo_outbox.group import GroupStatus, RelayGroup
from mongo_outbox.inbox import (
    Guarded,
    Inbox,
    Outcome,
    Result,
    inbox_guard,
)
from mongo_outbox.outbox import Outbox, Saved
from mongo_outbox.relay import PollingRelay, RelayCounters, RelayStats
from mongo_outbox.settings import Backoff, RelaySettings
from mongo_outbox.upcasters import Upcasters

__all__ = [
    "AggregateNotFoundError",
    "Backoff",
    "BrokerFullError",
    "BrokerUnavailableError",
    "ChangeStreamError",
    "ChangeStreamRelay",
    "ConcurrencyError",
    "ConfigurationError",
    "DeadLettered",
    "DuplicateEventError",
    "DuplicateSequenceError",
    "Event",
    "GroupStatus",
    "Guarded",
    "Inbox",
    "InboxError",
    "IncompatibleEventError",
    "InvalidAggregateError",
    "InvalidCountersError",
    "InvalidEventError",
    "MessageIdentityError",
    "Outbox",
    "OutboxError",
    "Outcome",
    "PoisonMessage",
    "PollingRelay",
    "PublishError",
    "RelayCounters",
    "RelayGroup",
    "RelaySettings",
    "RelayStats",
    "RelayStatus",
    "Result",
    "RetryLater",
    "Saved",
    "Upcasters",
    "UsageError",
    "inbox_guard",
    "new_event_id",
]

# The import paths of before answer from one table, each with a DeprecationWarning.
_moved.install()
