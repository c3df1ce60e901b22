"""What the async ``Outbox`` and ``mongo_outbox.sync.Outbox`` share: the settings, the storage
layout the relays read, and every write as steps (``_steps.py``), so the two APIs store the same
documents by the same rules.

A write with events: the rules make it a ``Plan`` (``rules.py``); the layout of the outbox's mode
(``layout.py``, chosen in ``layout_for``) records it around the aggregate document's write
(``documents.py``). In collection mode the entries are then inserted into the outbox collection,
in the same transaction. In embedded mode the document carries them, in one single-document
write, after the ids that can collide were reserved in the registry (``event_ids.py`` says which,
and why that second write loses nothing); a refused document write takes its reservations back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, ClassVar

from mongo_outbox._driver import driver_kind, is_async
from mongo_outbox._partitions import check_config, config_collection, partition_of
from mongo_outbox._steps import Steps
from mongo_outbox._write.aggregates import type_map
from mongo_outbox._write.collection_layout import CollectionLayout
from mongo_outbox._write.documents import DocumentWriter, bump
from mongo_outbox._write.embedded_layout import EmbeddedLayout
from mongo_outbox._write.event_ids import EventIds
from mongo_outbox._write.layout import Layout, Mode
from mongo_outbox._write.plan import Plan, Written
from mongo_outbox._write.rules import Rules, reserved_collection
from mongo_outbox.errors import ConfigurationError, UsageError
from mongo_outbox.events import utc_now
from mongo_outbox.settings import Duration, check_count, check_name, check_timedelta

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


def layout_for(
    mode: Any, db: Any, outbox: Any, collections: Sequence[str], field: str, registry: EventIds
) -> Layout:
    """The layout of ``mode``: the one place the write side tells the modes apart."""
    if mode == "collection":
        return CollectionLayout(outbox, field)
    if mode == "embedded":
        if not collections:
            raise ConfigurationError(
                "Outbox.collections: embedded mode needs collections=[...]: the relay scans only "
                "those",
                setting="Outbox.collections",
            )
        return EmbeddedLayout(db, collections, field, registry)
    raise ConfigurationError(
        f"Outbox.mode must be 'collection' or 'embedded', not {mode!r}", setting="Outbox.mode"
    )


_WRONG_API = {
    True: "mongo_outbox.Outbox is async: give it an AsyncDatabase (of an AsyncMongoClient) or a "
    "Motor database, not a {}; for a MongoClient use mongo_outbox.sync.Outbox",
    False: "mongo_outbox.sync.Outbox writes with PyMongo's sync API: give it a Database (of a "
    "MongoClient), not an {}; for an AsyncMongoClient or Motor use mongo_outbox.Outbox",
}


class WriteEngine:
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
        if isinstance(collections, str):  # a str is a sequence too: of one-letter names
            raise ConfigurationError(
                f"Outbox.collections must be a list of collection names, not the str "
                f"{collections!r}: write collections=[{collections!r}]",
                setting="Outbox.collections",
            )
        collections = tuple(collections)  # read once: an iterator would be empty the second time
        given = driver_kind(db)
        if given in ("collection", "client"):
            raise UsageError(
                f"Outbox takes the database of the aggregates (client['shop']), not a {given} "
                f"({type(db).__name__})"
            )
        if is_async(db) not in (None, self._ASYNC):
            raise UsageError(_WRONG_API[self._ASYNC].format(type(db).__name__))
        if not db.write_concern.acknowledged:
            raise ConfigurationError(
                f"database {db.name} writes unacknowledged (w=0): the outbox, its relays and its "
                "registry must know what was stored; use an acknowledged write concern",
                setting="Outbox.db",
            )
        check_field(field)
        retention = check_timedelta(retention, "Outbox.retention")
        check_name(collection, "Outbox.collection")
        # The outbox's own collections: an aggregate written there would corrupt them (its
        # partition record, its registry of event ids, its entries).
        internal = frozenset({collection, f"{collection}_config", f"{collection}_event_ids"})
        for name in collections:
            check_name(name, "Outbox.collections")
            whose = reserved_collection(name, internal)
            if whose:
                raise ConfigurationError(
                    f"Outbox.collections: {name} is {whose}, not a collection of aggregates",
                    setting="Outbox.collections",
                )
        self.event_ids = db[f"{collection}_event_ids"]
        self._registry = EventIds(self.event_ids, retention)
        self.layout = layout_for(mode, db, db[collection], collections, field, self._registry)
        self.partitions = check_count(partitions, "Outbox.partitions")
        self.db = db
        self.mode: Mode = mode
        self.retention = retention
        self.collection = db[collection]
        self.collections = tuple(collections)
        self.aggregate_types = type_map(aggregate_types, self.collections)
        # The relays' names for the embedded fields (a collection-mode outbox has them too).
        self.field = field
        self.due_field = f"{field}_due"
        self.claim_field = f"{field}_claim"
        self.wait_field = f"{field}_wait"
        self.sent_field = f"{field}_sent"
        self.partition_field = self.layout.partition_field
        self.config = config_collection(db, collection)
        self._config_checked = False
        self.owned_fields: frozenset[str] = self.layout.owned
        """The aggregate document's fields the outbox writes itself: its counters and, in
        embedded mode, its entries and their bookkeeping. A model's own fields never set them
        (the ODM integrations leave them out)."""
        self._internal = internal
        self._rules = Rules(db, self.layout, self.aggregate_types, self.owned_fields, internal)
        self._documents = DocumentWriter(self.layout)

    def check_relay_collection(self, name: str, setting: str) -> str:
        """``name``, for a relay's own records (checkpoints, leases, members), unless it is one
        of this outbox's collections, whose documents the records would overwrite."""
        check_name(name, setting)
        if name in self._internal or name in self.collections:
            whose = "the outbox's own" if name in self._internal else "one of its aggregates'"
            raise ConfigurationError(
                f"{setting}: {name} is {whose} collection, not a place for a relay's records",
                setting=setting,
            )
        return name

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
        yield from self.layout.indexes(self.partitions)

    def _transactional(self, session: Any) -> bool:
        """Whether a write must run in a transaction of its own."""
        return self.layout.own_transaction(session)

    def _steps(self, plan: Plan, session: Any) -> Steps[Written]:
        # Outside the caller's transaction (no session): a config read, at most one upsert.
        yield from self._check_config()
        if self.partitions > 1:  # also without events: a save must keep the stored number
            stamp = plan.stamp
            plan = replace(
                plan, partition=self.partition_of(stamp["aggregate_type"], stamp["aggregate_id"])
            )
        return (yield from self.layout.record(plan, session, self._write))

    def _write(self, plan: Plan, session: Any) -> Steps[Written]:
        n = len(plan.events)
        now = utc_now()
        if plan.kind == "add":
            version, last, existed = yield from bump(plan, session)
        else:
            version, last, existed = yield from self._documents.write(plan, session, now)
        first = last - n + 1
        events = [
            e.model_copy(update=plan.stamp | {"sequence": first + i})
            for i, e in enumerate(plan.events)
        ]
        yield from self.layout.insert_entries(plan, first, existed, now, session)
        return plan.doc_id, version, events
