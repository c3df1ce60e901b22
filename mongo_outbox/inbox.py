"""The consumer side: ``Inbox`` and ``inbox_guard`` make a handler's effects happen once.

A message's identity is (consumer, source, message id). Its inbox record has a unique index on
that identity and an ``expire_at`` that a TTL index honours.

Transactional mode: the record is written with ``status: "done"`` in the same transaction as the
handler's own writes, so either both commit or neither does, whatever crashes when.
Non-transactional mode: the record is claimed with ``status: "processing"`` and a lease, the
handler runs (told its attempt number), then the record is marked done. A crash leaves a claim
whose lease runs out, and the next delivery runs the handler again with the next attempt number:
its external calls must be idempotent (use the message id as the idempotency key).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import ConnectionFailure, DuplicateKeyError, OperationFailure, PyMongoError

from mongo_outbox._driver import start_session
from mongo_outbox.backoff import Backoff
from mongo_outbox.errors import (
    DeadLettered,
    MessageIdentityError,
    PoisonMessage,
    RetryLater,
    describe,
)
from mongo_outbox.events import Event, as_utc, utc_now

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[None]]
DeadLetter = Callable[[Event, str], Awaitable[None]]
"""``dead_letter(event, reason)``: where a poison message goes, e.g. a publisher's DLQ."""


class Outcome(enum.Enum):
    HANDLED = "handled"  # the handler ran and its effects are stored
    DUPLICATE = "duplicate"  # handled (or dead-lettered) before: skipped
    RETRY = "retry"  # failed for now, or another consumer holds it: deliver again after `delay`
    DEAD_LETTERED = "dead_lettered"  # poison: recorded as failed and sent to the dead letter


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    attempt: int = 0
    delay: float = 0.0
    error: str | None = None


class Inbox:
    """Where one consumer records the messages it handled.

    Parameters:
        db: a PyMongo ``AsyncDatabase`` or a Motor database.
        consumer: this handler's name; each consumer handles each message once.
        collection: the inbox collection's name.
        retention: how long records are kept. It must exceed the longest delay after which the
            broker may redeliver a message (TTL deletes run about once a minute).
        transactional: ``True`` or ``False``; ``None`` asks the server whether it is a replica
            set or sharded cluster.
        lease: how long a non-transactional claim holds before another delivery may retry it.
    """

    def __init__(
        self,
        db: Any,
        *,
        consumer: str,
        collection: str = "inbox",
        retention: timedelta = timedelta(days=30),
        transactional: bool | None = None,
        lease: timedelta = timedelta(seconds=60),
    ) -> None:
        if not consumer:
            raise ValueError("consumer must name the handler")
        if retention <= timedelta(0) or lease <= timedelta(0):
            raise ValueError("retention and lease must be positive")
        self.db = db
        self.consumer = consumer
        self.collection = db[collection]
        self.retention = retention
        self.transactional = transactional
        self.lease = lease
        self._indexed = False

    async def ensure_indexes(self) -> None:
        """Create the unique identity index and the TTL index. Idempotent."""
        await self.collection.create_index(
            [("consumer", 1), ("source", 1), ("message_id", 1)], unique=True, name="identity"
        )
        await self.collection.create_index("expire_at", expireAfterSeconds=0, name="ttl")
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

    async def _prepare(self) -> bool:
        # Without the unique index nothing would be deduplicated: never run without it.
        if not self._indexed:
            await self.ensure_indexes()
        return await self.uses_transactions()

    async def failed(self) -> list[dict[str, Any]]:
        """The records of messages dead-lettered by this consumer."""
        return list(
            await self.collection.find({"consumer": self.consumer, "status": "failed"}).to_list(
                None
            )
        )


def inbox_guard(
    inbox: Inbox,
    *,
    max_attempts: int = 5,
    backoff: Backoff | None = None,
    dead_letter: DeadLetter | None = None,
) -> Callable[[Handler], Guarded]:
    """Decorate ``async def handler(event, session)`` so it runs once per message.

    The decorated function returns ``True`` when it handled the event now and ``False`` for a
    duplicate; it raises ``RetryLater`` when the handler failed for now, and ``DeadLettered``
    once a message is poison (the handler raised ``PoisonMessage``, or ``max_attempts`` failed).
    A handler that takes an ``attempt`` keyword gets the attempt number (1 for the first).
    """
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")

    def decorate(handler: Handler) -> Guarded:
        return Guarded(inbox, handler, max_attempts, backoff or Backoff(), dead_letter)

    return decorate


class Guarded:
    """A handler wrapped by ``inbox_guard``; call it, or use ``handle`` for the full outcome."""

    def __init__(
        self,
        inbox: Inbox,
        handler: Handler,
        max_attempts: int,
        backoff: Backoff,
        dead_letter: DeadLetter | None,
    ) -> None:
        self.inbox = inbox
        self.handler = handler
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.dead_letter = dead_letter
        self._wants_attempt = "attempt" in inspect.signature(handler).parameters
        # Deliveries of one message in this process wait for each other instead of racing.
        self._busy: dict[tuple[str, str], _Busy] = {}
        self.__name__ = getattr(handler, "__name__", "guarded")
        self.__doc__ = handler.__doc__

    async def __call__(
        self, event: Event, *, message_id: str | None = None, source: str | None = None
    ) -> bool:
        result = await self.handle(event, message_id=message_id, source=source)
        if result.outcome is Outcome.RETRY:
            raise RetryLater(
                result.error or "retry later", attempt=result.attempt, delay=result.delay
            )
        if result.outcome is Outcome.DEAD_LETTERED:
            raise DeadLettered(result.error or "dead-lettered", attempt=result.attempt)
        return result.outcome is Outcome.HANDLED

    async def handle(
        self, event: Event, *, message_id: str | None = None, source: str | None = None
    ) -> Result:
        """Run the handler unless this message was handled; never raise for its failures.

        ``message_id`` defaults to the event id, ``source`` to the event's aggregate type.
        """
        message_id = message_id if message_id is not None else event.id
        if not message_id:
            raise MessageIdentityError("a message without an id cannot be deduplicated")
        source = source if source is not None else (event.aggregate_type or "")
        key = (source, message_id)
        busy = self._busy.setdefault(key, _Busy())
        busy.users += 1
        try:
            async with busy.lock:
                if await self.inbox._prepare():
                    return await self._transactional(event, source, message_id)
                return await self._leased(event, source, message_id)
        except PyMongoError as error:
            # The inbox itself could not be read or written (MongoDB unreachable, say): not the
            # message's fault, so not an attempt, and no reason to stop the consumer.
            log.warning("inbox of %s unavailable, retry later: %s", self.inbox.consumer, error)
            return Result(Outcome.RETRY, 0, self.backoff.delay(1), f"inbox unavailable: {error}")
        finally:
            busy.users -= 1
            if not busy.users:
                del self._busy[key]

    def _identity(self, source: str, message_id: str) -> dict[str, Any]:
        return {"consumer": self.inbox.consumer, "source": source, "message_id": message_id}

    async def _run(self, event: Event, session: Any, attempt: int) -> None:
        if self._wants_attempt:
            await self.handler(event, session, attempt=attempt)
        else:
            await self.handler(event, session)

    async def _transactional(self, event: Event, source: str, message_id: str) -> Result:
        identity = self._identity(source, message_id)
        coll = self.inbox.collection
        before: dict[str, Any] | None = None

        async def attempt_in_transaction(session: Any) -> None:
            nonlocal before
            now = utc_now()
            # The one write the inbox adds: done, in the handler's transaction.
            try:
                before = await coll.find_one_and_update(
                    identity,
                    {
                        "$set": {
                            "status": "done",
                            "event_type": event.type,
                            "processed_at": now,
                            "expire_at": now + self.inbox.retention,
                        },
                        "$inc": {"attempts": 1},
                    },
                    upsert=True,
                    return_document=ReturnDocument.BEFORE,
                    session=session,
                )
            except DuplicateKeyError as error:
                # Two first deliveries raced to create the record. Only this write's duplicate
                # key means that: the handler's own DuplicateKeyError is a handler failure.
                raise _Racing from error
            if before is not None and before.get("status") in ("done", "failed"):
                raise _Duplicate  # abort: a duplicate leaves the record as it was
            await self._run(event, session, _attempts(before) + 1)

        try:
            async with await start_session(self.inbox.db.client) as session:
                await session.with_transaction(attempt_in_transaction)
        except _Duplicate:
            return Result(Outcome.DUPLICATE, _attempts(before))
        except PoisonMessage as error:
            return await self._poison(event, identity, _attempts(before) + 1, str(error))
        except _Racing:
            # Whichever lost tries again, and will find the winner's record.
            return Result(Outcome.RETRY, _attempts(before), self.backoff.delay(1), "racing")
        except Exception as error:  # noqa: BLE001 - any handler failure is retried or poisoned
            if _is_conflict(error) or isinstance(error, ConnectionFailure):
                # Another transaction won, or MongoDB was out of reach: not the message's fault,
                # so not an attempt that counts towards max_attempts (a duplicate, or every
                # message during an outage, would be dead-lettered). The transaction rolled
                # back the record's count too.
                text = describe(error)
                return Result(Outcome.RETRY, _attempts(before), self.backoff.delay(1), text)
            return await self._failed(event, identity, _attempts(before) + 1, error)
        return Result(Outcome.HANDLED, _attempts(before) + 1)

    async def _leased(self, event: Event, source: str, message_id: str) -> Result:
        identity = self._identity(source, message_id)
        coll = self.inbox.collection
        now = utc_now()
        claim = {
            "status": "processing",
            "event_type": event.type,
            "lease_until": now + self.inbox.lease,
            "expire_at": now + self.inbox.retention,
        }
        try:
            await coll.insert_one(identity | claim | {"attempts": 1})
            attempt = 1
        except DuplicateKeyError:
            record = await coll.find_one_and_update(
                {
                    **identity,
                    "$or": [
                        {"status": "retrying"},
                        # A claim whose holder died: the ghost the lease exists for.
                        {"status": "processing", "lease_until": {"$lte": now}},
                    ],
                },
                {"$set": claim, "$inc": {"attempts": 1}},
                return_document=ReturnDocument.AFTER,
            )
            if record is None:
                current = await coll.find_one(identity)
                if current is None:  # pruned in between: a new message for all we know
                    return Result(Outcome.RETRY, 0, self.backoff.delay(1), "record vanished")
                if current["status"] in ("done", "failed"):
                    return Result(Outcome.DUPLICATE, _attempts(current))
                # Another consumer holds it: come back when its lease ends.
                left = (as_utc(current["lease_until"]) - now).total_seconds()
                return Result(Outcome.RETRY, _attempts(current), max(left, 0.0), "in progress")
            attempt = _attempts(record)
        try:
            await self._run(event, None, attempt)
        except PoisonMessage as error:
            return await self._poison(event, identity, attempt, str(error))
        except Exception as error:  # noqa: BLE001 - any handler failure is retried or poisoned
            return await self._failed(event, identity, attempt, error)
        done = utc_now()
        await coll.update_one(
            identity,
            {
                "$set": {
                    "status": "done",
                    "processed_at": done,
                    "expire_at": done + self.inbox.retention,
                },
                "$unset": {"lease_until": "", "last_error": ""},
            },
        )
        return Result(Outcome.HANDLED, attempt)

    async def _failed(
        self, event: Event, identity: dict[str, Any], attempt: int, error: BaseException
    ) -> Result:
        text = describe(error)
        if attempt >= self.max_attempts:
            return await self._poison(event, identity, attempt, f"gave up after {attempt}: {text}")
        delay = self.backoff.delay(attempt)
        log.warning(
            "handling %s failed (attempt %d), retry in %.1fs: %s",
            identity["message_id"],
            attempt,
            delay,
            text,
        )
        await self._record(identity, event, "retrying", attempt, text)
        return Result(Outcome.RETRY, attempt, delay, text)

    async def _poison(
        self, event: Event, identity: dict[str, Any], attempt: int, reason: str
    ) -> Result:
        log.error("dead-lettering %s after attempt %d: %s", identity["message_id"], attempt, reason)
        # Dead letter first: if it fails, the message is retried rather than marked lost.
        if self.dead_letter is not None:
            try:
                await self.dead_letter(event, reason)
            except Exception as error:  # noqa: BLE001 - retried like a handler failure
                text = f"dead letter failed: {describe(error)}"
                return Result(Outcome.RETRY, attempt, self.backoff.delay(attempt), text)
        await self._record(identity, event, "failed", attempt, reason)
        return Result(Outcome.DEAD_LETTERED, attempt, 0.0, reason)

    async def _record(
        self, identity: dict[str, Any], event: Event, status: str, attempt: int, error: str
    ) -> None:
        now = utc_now()
        try:
            await self.inbox.collection.update_one(
                {**identity, "status": {"$ne": "done"}},
                {
                    "$set": {
                        "status": status,
                        "attempts": attempt,
                        "last_error": error,
                        "event": event.model_dump(mode="json"),
                        "expire_at": now + self.inbox.retention,
                    },
                    "$unset": {"lease_until": ""},
                },
                upsert=True,
            )
        except DuplicateKeyError:
            pass  # it became done meanwhile: nothing to record
        except PyMongoError:
            # The broker redelivers and the attempt is counted again; nothing is lost.
            log.exception("could not record the %s state of %s", status, identity["message_id"])


class _Duplicate(Exception):
    pass


class _Racing(Exception):
    pass


def _is_conflict(error: BaseException) -> bool:
    """Whether a transaction failed because another one touched the same documents.

    ``with_transaction`` retries labelled conflicts (and commits of unknown outcome) for up to
    two minutes; a labelled one that still reaches us ran out of that time, and the redelivery
    will find out whether it committed. The mongoeco emulator reports a conflict at commit with
    neither the code (112) nor the label, only its message.
    """
    if not isinstance(error, PyMongoError):
        return False
    if error.has_error_label("TransientTransactionError") or error.has_error_label(
        "UnknownTransactionCommitResult"
    ):
        return True
    if isinstance(error, OperationFailure) and error.code == 112:
        return True
    return "write conflict" in str(error).lower()


class _Busy:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


def _attempts(record: dict[str, Any] | None) -> int:
    return int(record.get("attempts", 0)) if record else 0
