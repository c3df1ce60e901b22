"""The consumer side: ``Inbox`` and ``inbox_guard`` make a handler's effects happen once.

A message's identity is (consumer, source, message id). Its inbox record has a unique index on
that identity and an ``expire_at`` that a TTL index honours.

Transactional mode: the record is written with ``status: "done"`` in the same transaction as the
handler's own writes, so either both commit or neither does, whatever crashes when.
Leased mode: the record is claimed with ``status: "processing"`` for a processing lease, the
handler runs (told its attempt number), then the record is marked done. A crash leaves a claim
whose lease runs out, and the next delivery runs the handler again with the next attempt number:
its external calls must be idempotent (use the message id as the idempotency key).

This module holds the ``Inbox`` (where the records live and how long) and the words for what
becomes of a message (``Outcome``, ``Result``); the guard that runs a handler against an inbox
is in ``mongo_outbox.guard`` and is importable from here too.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from bson.codec_options import CodecOptions, DatetimeConversion
from pymongo.errors import OperationFailure

from mongo_outbox.errors import ConfigurationError, DeadLettered, RetryLater, UsageError
from mongo_outbox.events import Event, as_utc, utc_now
from mongo_outbox.settings import Duration, check_count, check_timedelta

if TYPE_CHECKING:
    from mongo_outbox._inbox_store import InboxStore
    from mongo_outbox.guard import Guarded, inbox_guard

__all__ = [
    "DeadLetter",
    "DeadLettered",
    "Guarded",
    "Inbox",
    "Outcome",
    "Result",
    "RetryLater",
    "inbox_guard",
]

# The inbox reads its own dates back whatever the user's client decodes them as (naive
# datetimes, or DatetimeMS with ``datetime_conversion=DATETIME_MS``), and its records as dicts.
_CODEC: CodecOptions[dict[str, Any]] = CodecOptions(
    tz_aware=True, datetime_conversion=DatetimeConversion.DATETIME
)


DeadLetter = Callable[[Event, str], Awaitable[None]]
"""``async dead_letter(event, reason)``: where a poison message goes, e.g. a publisher's DLQ."""


class Outcome(enum.Enum):
    """What became of one delivery of a message."""

    HANDLED = "handled"  # the handler ran and its effects are stored
    DUPLICATE = "duplicate"  # handled (or dead-lettered) before: skipped
    RETRY = "retry"  # failed for now, or another consumer holds it: deliver again after `delay`
    DEAD_LETTERED = "dead_lettered"  # poison: recorded as failed and sent to the dead letter


@dataclass(frozen=True)
class Result:
    """The outcome, the attempt it was (0 when none ran), the delay before a retry, and why."""

    outcome: Outcome
    attempt: int = 0
    delay: float = 0.0
    error: str | None = None


class Inbox:
    """Where one consumer records the messages it handled.

    Parameters:
        db: a PyMongo ``AsyncDatabase`` or a Motor database.
        consumer: this handler's name; each consumer handles each message once. Never give two
            different handlers one name: each would skip the messages the other handled.
        collection: the inbox collection's name. Which handler runs under each consumer name is
            kept in ``<collection>.handlers``.
        retention: how long records are kept (seconds or a ``timedelta``). It must exceed the
            longest delay after which the broker may redeliver a message (TTL deletes run about
            once a minute).
        transactional: ``True`` or ``False``; ``None`` asks the server whether it is a replica
            set or sharded cluster.
        processing_lease: leased mode only: how long a claim holds (seconds or a ``timedelta``)
            before another delivery may take the message over. It must exceed the handler's
            longest run.
    """

    def __init__(
        self,
        db: Any,
        *,
        consumer: str,
        collection: str = "inbox",
        retention: Duration = timedelta(days=30),
        transactional: bool | None = None,
        processing_lease: Duration = 60.0,
    ) -> None:
        for setting, value in (("Inbox.consumer", consumer), ("Inbox.collection", collection)):
            if not isinstance(value, str) or not value:
                raise ConfigurationError(
                    f"{setting} must be a non-empty str, not {value!r}", setting=setting
                )
        if transactional not in (None, True, False):
            raise ConfigurationError(
                f"Inbox.transactional must be True, False or None, not {transactional!r}",
                setting="Inbox.transactional",
            )
        self.retention = _until("Inbox.retention", retention)
        self.processing_lease = _until("Inbox.processing_lease", processing_lease)
        if transactional is not True and self.processing_lease >= self.retention:
            # A claim's record would expire while its holder runs, and a redelivery would run
            # the handler beside it. (Transactions take no lease.)
            raise ConfigurationError(
                "Inbox.processing_lease must be shorter than Inbox.retention",
                setting="Inbox.processing_lease",
            )
        self.db = db
        self.consumer = consumer
        self.collection = db.get_collection(collection, codec_options=_CODEC)
        self.handlers = db.get_collection(f"{collection}.handlers", codec_options=_CODEC)
        self.transactional = transactional
        self._indexed = False

    async def ensure_indexes(self) -> None:
        """Create the unique identity index, the TTL index and an index of the dead letters.
        Idempotent."""
        await self.collection.create_index(
            [("consumer", 1), ("source", 1), ("message_id", 1)], unique=True, name="identity"
        )
        await self.collection.create_index("expire_at", expireAfterSeconds=0, name="ttl")
        # Dead letters only, for failed() and an operator's counts: no cost per handled message.
        await self.collection.create_index(
            [("consumer", 1), ("failed_at", -1)],
            name="failures",
            partialFilterExpression={"status": "failed"},
        )
        self._indexed = True

    async def uses_transactions(self) -> bool:
        """Whether guarded handlers run in transactions (asks the server once if not told)."""
        if self.transactional is None:
            admin = self.db.client.admin
            try:
                hello = await admin.command("hello")
            except OperationFailure:  # servers before 4.4.2 only know the legacy name
                hello = await admin.command("isMaster")
            # Only replica set members and mongos run transactions. A server that emulates
            # transactions while reporting itself standalone (the mongoeco emulator) gets the
            # leased mode unless told otherwise: ``transactional=True``.
            self.transactional = "setName" in hello or hello.get("msg") == "isdbgrid"
        return self.transactional

    async def prepare(self) -> bool:
        """Create the indexes unless done already, and return ``uses_transactions()``."""
        # Without the unique index nothing would be deduplicated: never run without it.
        if not self._indexed:
            await self.ensure_indexes()
        return await self.uses_transactions()

    async def failed(
        self,
        *,
        event_type: str | None = None,
        since: datetime | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """The records of messages dead-lettered by this consumer, the latest first: each with
        its ``message_id``, ``source``, ``event_type``, the ``event``, ``attempts``,
        ``last_error`` and ``failed_at``. ``event_type`` keeps one type, ``since`` what failed
        at or after that time, ``limit`` at most that many."""
        if limit is not None:
            limit = check_count(limit, "Inbox.failed.limit")
        return await self._store().failed(event_type, _aware(since), limit)

    async def requeue(
        self,
        message_ids: Sequence[str] | None = None,
        *,
        event_type: str | None = None,
        all_failed: bool = False,
    ) -> int:
        """Give dead-lettered messages another chance: their next delivery runs the handler
        again, with a fresh set of attempts, instead of being skipped as a duplicate. The broker
        has settled them, so something must deliver them again (``mongo-outbox replay``, or
        the dead letter's own copy). Chooses the messages ``message_ids`` (of any source),
        those of ``event_type``, both (those ids of that type), or ``all_failed``. Only failed
        records change: a message that a delivery is handling is left alone. Returns how many
        were requeued."""
        if isinstance(message_ids, str):
            raise UsageError("Inbox.requeue takes a list of message ids, not one str")
        chosen = message_ids is not None or event_type is not None
        if chosen == all_failed:
            raise UsageError(
                "Inbox.requeue needs message_ids, event_type (or both), or all_failed=True alone"
            )
        return await self._store().requeue(message_ids, event_type)

    def _store(self) -> InboxStore:
        # Imported when used: the store imports this module for the Inbox.
        from mongo_outbox._inbox_store import InboxStore

        return InboxStore(self)


def _aware(at: datetime | None) -> datetime | None:
    if at is not None and not isinstance(at, datetime):
        raise UsageError(f"since must be a datetime, not {type(at).__name__}")
    return as_utc(at) if at is not None else None


def _until(setting: str, value: Duration) -> timedelta:
    try:
        period = check_timedelta(value, setting)
        utc_now() + period  # every record's expiry is computed like this
    except OverflowError:
        raise ConfigurationError(f"{setting} is too long: {value!r}", setting=setting) from None
    return period


def __getattr__(name: str) -> Any:
    # The guard is imported when asked for: it imports this module for the Inbox.
    if name in ("Guarded", "inbox_guard"):
        from mongo_outbox import guard

        return getattr(guard, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
