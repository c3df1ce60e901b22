"""How ``inbox_guard`` reads and writes inbox records: the one place that knows their shape.

A record is keyed by its identity (consumer, source, message id) and moves through
``processing`` (leased mode only) and ``retrying`` to ``done`` or ``failed``. Every record has
``attempts`` (how many times the handler ran for it) and an ``expire_at`` for the TTL index.

Leased mode fences its claims like the relay's store: a claim is a value holding a random
``token``, and every later write of that holder filters on it. A holder whose lease ran out and
whose claim another delivery took over therefore writes nothing: it can neither overwrite the
live claim nor release it to a third delivery.

A message whose handler is done with (refused for good, or out of attempts) but whose dead
letter failed is released as ``retrying`` with a ``verdict``: the next delivery only retries the
dead letter, it does not run the handler again.

A dead-lettered record (``failed``, with ``failed_at``) is terminal until an operator requeues
it: it becomes ``retrying`` with no attempts counted, no verdict and no claim token, so the next
delivery claims it and runs the handler afresh, and a holder of an older claim matches nothing.
Only ``failed`` records are requeued, so a message that a delivery holds is never touched.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from mongo_outbox._commands import chunked
from mongo_outbox._driver import aggregate
from mongo_outbox.events import Event, utc_now

Identity = dict[str, str]


class InboxSettings(Protocol):
    """What the store reads of a ``mongo_outbox.inbox.Inbox``: where its records live, whose
    they are and how long they hold. That module builds stores, so this one names what it needs
    instead of importing it."""

    db: Any
    consumer: str
    collection: Any
    handlers: Any
    retention: timedelta
    processing_lease: timedelta


@dataclass(frozen=True)
class MessageClaim:
    """A leased hold on one message; ``token`` fences every later write of its holder."""

    identity: Identity
    token: str
    attempt: int
    """This claim's attempt number: earlier handler runs plus one."""
    verdict: str | None
    """Why the message was dead-lettered, when only its dead letter remains to be done."""
    last_error: str | None


@dataclass(frozen=True)
class ClaimRefused:
    """Why a message could not be claimed."""

    status: str
    """``done``, ``failed``, ``processing`` (another delivery holds it), or ``missing``."""
    attempts: int
    wait: float
    """Seconds until the holder's lease ends."""


class InboxStore:
    """The records of one inbox, read and written with codec options of the library's own."""

    def __init__(self, inbox: InboxSettings) -> None:
        self.inbox = inbox
        self.coll = inbox.collection
        self.handlers = inbox.handlers

    def identity(self, source: str, message_id: str) -> Identity:
        return {"consumer": self.inbox.consumer, "source": source, "message_id": message_id}

    async def register(self, handler: str) -> str | None:
        """Record ``handler`` as the one this consumer runs. Returns the handler recorded before
        it when that was another one: two handlers sharing a consumer name would each skip the
        messages the other handled."""
        try:
            before = await self.handlers.find_one_and_update(
                {"_id": self.inbox.consumer},
                {"$set": {"handler": handler, "seen_at": utc_now()}},
                upsert=True,
                return_document=ReturnDocument.BEFORE,
            )
        except DuplicateKeyError:
            return None  # two first uses at once: the next start compares again
        previous = before.get("handler") if before else None
        return previous if previous is not None and previous != handler else None

    # Leased mode.

    async def claim(self, identity: Identity, event: Event) -> MessageClaim | ClaimRefused:
        now = utc_now()
        token = uuid.uuid4().hex
        fields = {
            "status": "processing",
            "event_type": event.type,
            "token": token,
            "lease_until": now + self.inbox.processing_lease,
            "expire_at": now + self.inbox.retention,
        }
        try:
            await self.coll.insert_one(identity | fields | {"attempts": 1})
            return MessageClaim(identity, token, 1, None, None)
        except DuplicateKeyError:
            pass
        record = await self.coll.find_one_and_update(
            {
                **identity,
                "$or": [
                    {"status": "retrying"},
                    # A claim whose holder died (or overran its lease): the ghost leases exist for.
                    {"status": "processing", "lease_until": {"$lte": now}},
                ],
            },
            {"$set": fields, "$inc": {"attempts": 1}},
            return_document=ReturnDocument.AFTER,
        )
        if record is not None:
            return MessageClaim(
                identity,
                token,
                attempts_of(record),
                record.get("verdict"),
                record.get("last_error"),
            )
        current = await self.coll.find_one(identity)
        if current is None:  # pruned in between: a new message for all we know
            return ClaimRefused("missing", 0, 0.0)
        wait = 0.0
        if current["status"] == "processing":
            wait = max((current["lease_until"] - now).total_seconds(), 0.0)
        return ClaimRefused(current["status"], attempts_of(current), wait)

    async def finish(self, claim: MessageClaim) -> bool:
        """Mark the claimed message done; ``False`` if the claim was taken over meanwhile."""
        now = utc_now()
        result = await self.coll.update_one(
            {**claim.identity, "token": claim.token},
            {
                "$set": {
                    "status": "done",
                    "processed_at": now,
                    "expire_at": now + self.inbox.retention,
                },
                "$unset": {"token": "", "lease_until": "", "last_error": "", "verdict": ""},
            },
        )
        return bool(result.matched_count)

    async def release(
        self,
        claim: MessageClaim,
        status: str,
        attempt: int,
        error: str,
        event: Event,
        verdict: str | None = None,
    ) -> bool:
        """Release the claim as ``retrying`` or ``failed``; ``False`` if it was taken over."""
        result = await self.coll.update_one(
            {**claim.identity, "token": claim.token},
            self._state(status, attempt, error, event, verdict, unset={"token": ""}),
        )
        return bool(result.matched_count)

    async def let_go(self, claim: MessageClaim) -> bool:
        """Give the claim up without spending its attempt: its handler was stopped (cancelled),
        not failed, so the next delivery claims the message at once, as the attempt it was.
        ``False`` if the claim was taken over or settled meanwhile."""
        result = await self.coll.update_one(
            {**claim.identity, "token": claim.token},
            {
                "$set": {"status": "retrying"},
                "$inc": {"attempts": -1},
                "$unset": {"token": "", "lease_until": ""},
            },
        )
        return bool(result.matched_count)

    # Dead letters.

    def _failed(self, message_ids: Sequence[str] | None, event_type: str | None) -> dict[str, Any]:
        query: dict[str, Any] = {"consumer": self.inbox.consumer, "status": "failed"}
        if message_ids is not None:
            query["message_id"] = {"$in": list(message_ids)}
        if event_type is not None:
            query["event_type"] = event_type
        return query

    async def failed(
        self, event_type: str | None, since: datetime | None, limit: int | None
    ) -> list[dict[str, Any]]:
        query = self._failed(None, event_type)
        if since is not None:
            query["failed_at"] = {"$gte": since}
        cursor = self.coll.find(query).sort([("failed_at", -1), ("_id", -1)])
        if limit is not None:
            cursor = cursor.limit(limit)
        return list(await cursor.to_list(None))

    async def count_failed(self) -> int:
        """How many messages this consumer has dead-lettered now (the ``failures`` index)."""
        return int(await self.coll.count_documents(self._failed(None, None)))

    async def requeue(self, message_ids: Sequence[str] | None, event_type: str | None) -> int:
        """Make failed records ``retrying`` afresh; return how many. Ids go in commands of
        bounded size: many long ids in one ``$in`` outgrew the 16 MiB a command may hold."""
        now = utc_now()
        update = {
            "$set": {
                "status": "retrying",
                "attempts": 0,
                "requeued_at": now,
                "expire_at": now + self.inbox.retention,
            },
            # No token: whoever claimed it before can no longer write to it.
            "$unset": {"token": "", "lease_until": "", "verdict": ""},
        }
        if message_ids is None:
            result = await self.coll.update_many(self._failed(None, event_type), update)
            return int(result.modified_count)
        requeued = 0
        for chunk in chunked(list(message_ids)):
            result = await self.coll.update_many(self._failed(chunk, event_type), update)
            requeued += result.modified_count
        return requeued

    # Transactional mode.

    async def mark_done(
        self, identity: Identity, event: Event, session: Any
    ) -> dict[str, Any] | None:
        """Write the record as done inside ``session``'s transaction; return it as it was.
        Raises ``DuplicateKeyError`` when another first delivery created it meanwhile."""
        now = utc_now()
        before: dict[str, Any] | None = await self.coll.find_one_and_update(
            identity,
            {
                "$set": {
                    "status": "done",
                    "event_type": event.type,
                    "processed_at": now,
                    "expire_at": now + self.inbox.retention,
                },
                "$inc": {"attempts": 1},
                "$unset": {"last_error": "", "verdict": ""},
            },
            upsert=True,
            return_document=ReturnDocument.BEFORE,
            session=session,
        )
        return before

    async def record(
        self,
        identity: Identity,
        status: str,
        attempt: int,
        error: str,
        event: Event,
        verdict: str | None = None,
    ) -> None:
        """Record ``retrying`` or ``failed`` after the handler's transaction rolled back; a record
        that became done or failed meanwhile stays as it is."""
        # A duplicate key means it is done or failed by now: nothing to record.
        with contextlib.suppress(DuplicateKeyError):
            await self.coll.update_one(
                {**identity, "status": {"$nin": ["done", "failed"]}},
                self._state(status, attempt, error, event, verdict, unset={}),
                upsert=True,
            )

    def _state(
        self,
        status: str,
        attempt: int,
        error: str,
        event: Event,
        verdict: str | None,
        unset: dict[str, str],
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "status": status,
            "event_type": event.type,
            "attempts": attempt,
            "last_error": error,
            "event": event.model_dump(mode="json"),
            "expire_at": utc_now() + self.inbox.retention,
        }
        if status == "failed":
            fields["failed_at"] = utc_now()
        unset = unset | {"lease_until": ""}
        if verdict is None:
            unset["verdict"] = ""
        else:
            fields["verdict"] = verdict
        return {"$set": fields, "$unset": unset}


async def failures(coll: Any) -> dict[str, int]:
    """How many messages each consumer of the inbox collection ``coll`` has dead-lettered."""
    rows = await aggregate(
        coll,
        [
            {"$match": {"status": "failed"}},
            {"$group": {"_id": "$consumer", "n": {"$sum": 1}}},
        ],
    )
    return {str(row["_id"]): int(row["n"]) for row in sorted(rows, key=lambda r: str(r["_id"]))}


def attempts_of(record: dict[str, Any] | None) -> int:
    return int(record.get("attempts", 0)) if record else 0
