"""What the async ``Outbox`` and ``mongo_outbox.sync.Outbox`` share: the settings, the storage
layout the relays read, and every write as steps (``_steps.py``), so the two APIs store the same
documents by the same rules.

A write with events, in collection mode: the aggregate document (``_documents.py``), then its
entries inserted into the outbox collection, in one transaction. In embedded mode: the document
with its entries in one single-document write, after reserving in the registry the ids that can
collide (``_event_ids.py`` says which, and why that second write loses nothing); a refused
document write takes its reservations back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, ClassVar, Literal

from bson.errors import InvalidDocument
from pymongo.errors import (
    BulkWriteError,
    DuplicateKeyError,
    OperationFailure,
    PyMongoError,
    WriteConcernError,
)

from mongo_outbox._aggregates import type_map
from mongo_outbox._documents import DocumentWriter, bump
from mongo_outbox._driver import DUPLICATE_KEY, is_async
from mongo_outbox._event_ids import EventIds, forget, mark
from mongo_outbox._partitions import check_config, config_collection, partition_of
from mongo_outbox._plans import Plan, Rules
from mongo_outbox._refusals import write_errors
from mongo_outbox._steps import Steps, call
from mongo_outbox.errors import (
    ConfigurationError,
    DuplicateEventError,
    InvalidCountersError,
    OutboxError,
    UsageError,
)
from mongo_outbox.events import Event, utc_now
from mongo_outbox.settings import Duration, check_count, check_name, check_timedelta

log = logging.getLogger(__name__)

Mode = Literal["collection", "embedded"]
Written = tuple[Any, int, list[Event]]
"""A write's result: the aggregate's ``_id``, its new version, the events as stored."""


# What the driver raises while it encodes a command, so before sending it: a value the rules
# could not see (they refuse what they can). Not InvalidOperation: a retry after a network error
# raises it for a client closed meanwhile, when the first attempt may have been applied.
_UNSENT = (InvalidDocument, OverflowError)
_NOT_A_FIELD = frozenset({"_id", "_version", "_sequence"})


def check_field(field: Any) -> None:
    """The embedded entries' field: one top-level name MongoDB stores as it is."""
    if (
        not isinstance(field, str)
        or not field
        or field in _NOT_A_FIELD
        or field.startswith("$")
        or "." in field
        or "\x00" in field
    ):
        raise ConfigurationError(
            f"field must be a top-level field name (no '.', no leading '$', not _id, _version "
            f"or _sequence), not {field!r}",
            setting="Outbox.field",
        )


_WRONG_API = {
    True: "mongo_outbox.Outbox is async: give it an AsyncDatabase (of an AsyncMongoClient) or a "
    "Motor database, not a {}; for a MongoClient use mongo_outbox.sync.Outbox",
    False: "mongo_outbox.sync.Outbox writes with PyMongo's sync API: give it a Database (of a "
    "MongoClient), not an {}; for an AsyncMongoClient or Motor use mongo_outbox.Outbox",
}


class OutboxCore:
    """The settings and writes of an outbox; see ``mongo_outbox.Outbox`` for the parameters."""

    _ASYNC: ClassVar[bool]
    """Whether the subclass's methods are coroutines: its ``db`` must be of that API."""

    def __init__(
        self,
        db: Any,
        *,
        mode: Mode = "collection",
        collection: str = "outbox",
        collections: Sequence[str] = (),
        retention: Duration = timedelta(days=7),
        field: str = "_outbox",
        aggregate_types: Mapping[str, str] | None = None,
        partitions: int = 1,
    ) -> None:
        if is_async(db) not in (None, self._ASYNC):
            raise UsageError(_WRONG_API[self._ASYNC].format(type(db).__name__))
        if mode not in ("collection", "embedded"):
            raise ConfigurationError(
                f"Outbox.mode must be 'collection' or 'embedded', not {mode!r}",
                setting="Outbox.mode",
            )
        if not db.write_concern.acknowledged:
            raise ConfigurationError(
                f"database {db.name} writes unacknowledged (w=0): the outbox, its relays and its "
                "registry must know what was stored; use an acknowledged write concern",
                setting="Outbox.db",
            )
        check_field(field)
        if mode == "embedded" and not collections:
            raise ConfigurationError(
                "Outbox.collections: embedded mode needs collections=[...]: the relay scans only "
                "those",
                setting="Outbox.collections",
            )
        retention = check_timedelta(retention, "Outbox.retention")
        check_name(collection, "Outbox.collection")
        self.partitions = check_count(partitions, "Outbox.partitions")
        self.db = db
        self.mode: Mode = mode
        self.retention = retention
        self.collection = db[collection]
        self.collections = tuple(collections)
        self.aggregate_types = type_map(aggregate_types, self.collections)
        self.event_ids = db[f"{collection}_event_ids"]
        self.field = field
        self.due_field = f"{field}_due"
        self.claim_field = f"{field}_claim"
        self.wait_field = f"{field}_wait"
        self.sent_field = f"{field}_sent"
        self.partition_field = f"{field}_partition" if mode == "embedded" else "partition"
        self.config = config_collection(db, collection)
        self._config_checked = False
        owned = {"_version", "_sequence"}
        if mode == "embedded":
            owned |= {field, self.due_field, self.claim_field, self.wait_field, self.sent_field}
            owned |= {self.partition_field}
        self._reserved = frozenset(owned)
        self._rules = Rules(db, mode, self.collections, self.aggregate_types, self._reserved)
        self._registry = EventIds(self.event_ids, retention)
        self._documents = DocumentWriter(mode, field, self.partition_field)

    def partition_of(self, aggregate_type: Any, aggregate_id: Any) -> int:
        """The partition of an aggregate's entries (0 when the outbox has one partition)."""
        return partition_of(aggregate_type, aggregate_id, self.partitions)

    def _check_config(self) -> Steps[None]:
        """Once per outbox object: refuse a partition count other than the recorded one."""
        if not self._config_checked:
            yield from check_config(self.config, self.partitions, "this Outbox")
            self._config_checked = True

    def _index_steps(self) -> Steps[None]:
        """The indexes the relay and the TTL pruning need. Idempotent."""
        yield from self._check_config()
        if self.mode == "collection":
            outbox = self.collection
            if self.partitions > 1:
                # A group member's claims: its partition's due entries.
                yield call(
                    outbox,
                    "create_index",
                    [("partition", 1), ("status", 1), ("available_at", 1)],
                    name="relay_partition_due",
                )
            yield call(
                outbox, "create_index", [("status", 1), ("available_at", 1)], name="relay_due"
            )
            yield call(
                outbox,
                "create_index",
                [("aggregate_type", 1), ("aggregate_id", 1), ("sequence", 1)],
                name="aggregate",
            )
            # Only published entries get expire_at, so pending ones never expire.
            yield call(outbox, "create_index", "expire_at", expireAfterSeconds=0, name="ttl")
            # Entries waiting for the broker, woken at once when it is back.
            yield call(outbox, "create_index", "waiting", sparse=True, name="waiting")
            return
        for name in self.collections:
            aggregates = self.db[name]
            if self.partitions > 1:
                yield call(
                    aggregates,
                    "create_index",
                    [(self.partition_field, 1), (self.due_field, 1)],
                    sparse=True,
                    name=f"{self.field}_partition_due",
                )
            yield call(
                aggregates,
                "create_index",
                self.due_field,
                sparse=True,
                name=f"{self.field}_relay_due",
            )
            # Parked entries stay in their documents; this finds them without a scan.
            yield call(
                aggregates,
                "create_index",
                f"{self.field}.parked",
                sparse=True,
                name=f"{self.field}_parked",
            )
            yield call(
                aggregates, "create_index", self.wait_field, sparse=True, name=f"{self.field}_wait"
            )
        yield from self._registry.ensure_index()

    def _transactional(self, session: Any) -> bool:
        """Whether a write must run in a transaction of its own: collection mode writes two
        collections, unless the caller's transaction holds them already."""
        return self.mode == "collection" and not (session is not None and session.in_transaction)

    def _steps(self, plan: Plan, session: Any) -> Steps[Written]:
        # Outside the caller's transaction (no session): a config read, at most one upsert.
        yield from self._check_config()
        if self.partitions > 1:  # also without events: a save must keep the stored number
            stamp = plan.stamp
            plan = replace(
                plan, partition=self.partition_of(stamp["aggregate_type"], stamp["aggregate_id"])
            )
        if self.mode == "collection":
            return (yield from self._write(plan, session))
        name = plan.collection.name
        home = (plan.collection.full_name, plan.doc_id)
        in_transaction = session is not None and session.in_transaction
        # Remembered before the first database call, so that a concurrent save of the same
        # object elsewhere (another task, another thread) is refused; the home not in a
        # transaction, which the caller may abort. The copies the save returns (made from
        # plan.events) carry the marks too.
        ids, before = mark(plan.given, plan.events, home, in_transaction)
        if ids:
            plan = replace(plan, may_be_stored=tuple(ids))
        try:
            if ids:
                self._rules.check_registry_id(plan.doc_id, name)
            reserved = yield from self._registry.reserve(ids, name, plan.doc_id, session)
        except BaseException:
            forget(before)  # the document was not written
            raise
        try:
            return (yield from self._write(plan, session))
        except (OutboxError, OperationFailure, *_UNSENT) as refused:
            if isinstance(refused, (WriteConcernError, InvalidCountersError)):
                raise  # the write happened (or is in a transaction that decides)
            # The document write was refused, or never sent, and wrote nothing: take the
            # reservations back. (Not after a network error or a cancellation: the write may
            # have happened.)
            forget(before)
            try:
                yield from self._registry.release(reserved, name, plan.doc_id, session)
            except PyMongoError as error:  # e.g. the transaction the refusal aborted
                # A pending reservation has no expiry: the ids stay this document's (a retry of
                # the save goes on with them), unless the aborted transaction took them along.
                log.warning(
                    "event ids %s stay reserved for %s %r unless their transaction was aborted: %s",
                    reserved,
                    name,
                    plan.doc_id,
                    error,
                )
            raise refused

    def _write(self, plan: Plan, session: Any) -> Steps[Written]:
        n = len(plan.events)
        now = utc_now()
        if plan.kind == "add":
            version, last = yield from bump(plan, session)
        else:
            version, last = yield from self._documents.write(plan, session, now)
        first = last - n + 1
        events = [
            e.model_copy(update=plan.stamp | {"sequence": first + i})
            for i, e in enumerate(plan.events)
        ]
        if self.mode == "collection" and events:
            pending = {"status": "pending", "available_at": now, "attempts": 0}
            if plan.partition is not None:
                pending["partition"] = plan.partition
            entries = [
                entry | {"sequence": first + i} | pending for i, entry in enumerate(plan.entries)
            ]
            try:
                if len(entries) == 1:  # the cheaper command for the commonest case
                    yield call(self.collection, "insert_one", entries[0], session=session)
                else:
                    yield call(self.collection, "insert_many", entries, session=session)
            except (BulkWriteError, DuplicateKeyError) as error:
                if not _duplicate(error):
                    raise
                raise DuplicateEventError(
                    f"an event id is already in {self.collection.name} (pending, or published "
                    f"less than retention ago): {error}",
                    collection=plan.collection.name,
                ) from error
        return plan.doc_id, version, events


def _duplicate(error: BulkWriteError | DuplicateKeyError) -> bool:
    if isinstance(error, DuplicateKeyError):
        return True
    return any(e.get("code") == DUPLICATE_KEY for e in write_errors(error))
