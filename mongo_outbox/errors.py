"""The one error hierarchy of mongo-outbox.

::

    OutboxError
    ├── InvalidEventError        an Event or its payload cannot be stored or sent
    ├── IncompatibleEventError   an event's version is one this reader cannot read (newer than
    │                            it, or older than its upcasters reach)
    ├── InvalidAggregateError    the document, collection or session cannot be saved with events
    │   └── InvalidCountersError the stored _version or _sequence is no whole number
    ├── ConfigurationError       a setting is out of range (a duration, a count, a template)
    ├── UsageError               the API was called in a way it does not support
    ├── ConcurrencyError         the stored aggregate moved on (``expected_version`` mismatch)
    ├── AggregateNotFoundError   no document matches an update's or delete's filter
    ├── DuplicateEventError      an event id is already in the outbox
    ├── DuplicateSequenceError   an aggregate's sequence is already in the outbox (collection mode)
    ├── PublishError             the broker did not confirm a message
    │   └── BrokerUnavailableError  the broker could not be reached: not the message's fault
    │       └── BrokerFullError      the broker refused for want of room (queue or stream full)
    ├── ChangeStreamError        a change stream failed in a way resuming cannot fix
    └── InboxError
        ├── MessageIdentityError a message has no usable id to deduplicate on
        ├── PoisonMessage        raise it from a handler: never retry this message
        ├── RetryLater           a guarded handler failed for now: deliver again after ``delay``
        └── DeadLettered         a guarded message was given up on: recorded, dead-lettered

Every error carries the context it is about as attributes, so a handler can log or route it
without parsing the message.
"""

from __future__ import annotations

import asyncio
from typing import Any


class OutboxError(Exception):
    """Root of every error mongo-outbox raises on purpose."""


def describe(error: BaseException) -> str:
    """``"TypeName: message"``: how an error is recorded in ``last_error`` fields and logs."""
    return f"{type(error).__name__}: {error}"


class ConfigurationError(OutboxError, ValueError):
    """A constructor argument is out of range; ``setting`` names it."""

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


class UsageError(OutboxError, RuntimeError):
    """The API was used in a way it does not support, e.g. one relay object run twice at once."""


class InvalidEventError(OutboxError, ValueError):
    def __init__(self, message: str, *, event_id: str | None = None) -> None:
        super().__init__(message)
        self.event_id = event_id


class IncompatibleEventError(OutboxError):
    """An event whose payload version this reader cannot read: ``version`` is the event's,
    ``supported`` the one the reader wants (its model's, or its upcasters' latest). ``newer``
    says which way: an event newer than the reader (deploy a newer consumer), or one older
    than the reader's upcasters reach (register the missing step). Either way the event itself
    is fine: a guarded handler dead-letters it with its inbox record, to be requeued once the
    reader can read it (docs/evolving-events.md). ``reader`` names who wanted ``supported``
    (``"the model OrderPlaced"``, ``"consumer billing"``)."""

    def __init__(
        self,
        message: str,
        *,
        event_id: str,
        event_type: str,
        version: int,
        supported: int,
        reader: str = "",
    ) -> None:
        super().__init__(message)
        self.event_id = event_id
        self.event_type = event_type
        self.version = version
        self.supported = supported
        self.reader = reader

    @property
    def newer(self) -> bool:
        return self.version > self.supported


class InvalidAggregateError(OutboxError, ValueError):
    def __init__(self, message: str, *, collection: str | None = None) -> None:
        super().__init__(message)
        self.collection = collection


class InvalidCountersError(InvalidAggregateError):
    """The aggregate's stored ``_version`` or ``_sequence`` is no whole number from 0 to 2**63 - 1
    (other code wrote it), found in what the write returned, so after the write: ``stored``
    says whether that write stands (embedded mode, outside a transaction) or is in a transaction
    that commits or aborts with it."""

    def __init__(self, message: str, *, collection: str, aggregate_id: Any, stored: bool) -> None:
        super().__init__(message, collection=collection)
        self.aggregate_id = aggregate_id
        self.stored = stored


class ConcurrencyError(OutboxError):
    """The stored document is not at ``expected_version``; ``None``: no version was expected,
    and other writers changed the document under the write at each of its tries."""

    def __init__(
        self, message: str, *, collection: str, aggregate_id: Any, expected_version: int | None
    ) -> None:
        super().__init__(message)
        self.collection = collection
        self.aggregate_id = aggregate_id
        self.expected_version = expected_version


class AggregateNotFoundError(OutboxError):
    """No document matches the filter of ``update_with_events`` (without ``upsert``) or
    ``delete_with_events``, or ``add_events`` found no aggregate document to count on.
    ``exists``: a document with that ``_id`` is there, but the rest of the filter does not hold
    (``None``: not known)."""

    def __init__(
        self, message: str, *, collection: str, aggregate_id: Any, exists: bool | None = None
    ) -> None:
        super().__init__(message)
        self.collection = collection
        self.aggregate_id = aggregate_id
        self.exists = exists


class DuplicateEventError(OutboxError):
    """An event id is taken already: by another entry, pending or published less than the
    outbox's retention ago. ``event_id`` is the id, when the server or the registry said which."""

    def __init__(self, message: str, *, collection: str, event_id: str | None = None) -> None:
        super().__init__(message)
        self.collection = collection
        self.event_id = event_id


class DuplicateSequenceError(OutboxError):
    """The outbox collection already holds an event of ``(aggregate_type, aggregate_id)`` under
    ``sequence`` (or a later one), so the events of this write would repeat sequences consumers
    have seen: the aggregate document lost its counters (a replace that dropped the outbox's
    fields), or it was deleted and created again under the same ``_id``. Nothing was written.
    ``collection`` is the outbox collection. ``Outbox.ensure_indexes`` raises it too, for entries
    stored before their unique index existed."""

    def __init__(
        self,
        message: str,
        *,
        collection: str,
        aggregate_type: str | None,
        aggregate_id: Any,
        sequence: Any,
    ) -> None:
        super().__init__(message)
        self.collection = collection
        self.aggregate_type = aggregate_type
        self.aggregate_id = aggregate_id
        self.sequence = sequence


class PublishError(OutboxError):
    def __init__(self, message: str, *, event_id: str) -> None:
        super().__init__(message)
        self.event_id = event_id


class BrokerUnavailableError(PublishError):
    """The broker could not be reached, or refused everything, e.g. while it restarts. The relay
    retries such a failure without counting it towards ``max_attempts``: an outage must not
    dead-letter events that did nothing wrong.

    ``destination`` is set when the broker answered but had nowhere to put this message (a
    subject no stream captures, a routing key no queue is bound to): while the broker confirms
    other events, such a failure is the event's own and counts (see docs/failures.md).
    """

    def __init__(self, message: str, *, event_id: str, destination: str | None = None) -> None:
        super().__init__(message, event_id=event_id)
        self.destination = destination


class BrokerFullError(BrokerUnavailableError):
    """The broker is up but has no room: a RabbitMQ queue at its ``x-max-length`` with
    ``reject-publish``, or a JetStream stream at its limits with the discard-new policy. Like an
    outage it is retried without counting an attempt, so it never parks an event or lets a
    later event of its aggregate overtake it."""


def unavailable(error: BaseException) -> bool:
    """Whether a publish failed for want of a broker rather than because of its message."""
    return isinstance(error, (BrokerUnavailableError, OSError, asyncio.TimeoutError))


class ChangeStreamError(OutboxError):
    """The change stream failed in a way that resuming cannot fix (e.g. not authorized)."""

    def __init__(self, message: str, *, relay: str, code: int | None = None) -> None:
        super().__init__(message)
        self.relay = relay
        self.code = code


class InboxError(OutboxError):
    pass


class MessageIdentityError(InboxError, ValueError):
    """A message has no id to deduplicate on, or one that is not a non-empty string;
    ``message_id`` is what it had."""

    def __init__(self, message: str, *, message_id: object = None) -> None:
        super().__init__(message)
        self.message_id = message_id


class PoisonMessage(InboxError):
    """Raised by a handler (or by the consumer helpers) for a message that must not be retried."""


class RetryLater(InboxError):
    """The handler failed for now (or another consumer holds the message): deliver it again
    after ``delay`` seconds."""

    def __init__(self, message: str, *, attempt: int, delay: float) -> None:
        super().__init__(message)
        self.attempt = attempt
        self.delay = delay


class DeadLettered(InboxError):
    """The message was given up on: it was recorded as failed and sent to the dead letter."""

    def __init__(self, message: str, *, attempt: int) -> None:
        super().__init__(message)
        self.attempt = attempt
