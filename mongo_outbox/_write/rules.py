"""The rules every write with events obeys, checked before anything is written: one place for
both the async ``Outbox`` and ``mongo_outbox.sync.Outbox``.

A ``Plan`` is a write that passed them: the collection of the outbox's own client and database
(and, in embedded mode, one its relay scans), the aggregate's ``_id``, its events stamped with
``aggregate_type`` and ``aggregate_id`` (``stamped_events``) and encoded as entries (by the
layout, ``layout.py``), a document, filter or update MongoDB will take, and sizes within
MongoDB's limits. What only the server can find (an update that
does not apply to the stored document, a document grown too large) fails the one write that
would have stored it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import bson
from bson import ObjectId
from bson.errors import InvalidDocument
from pydantic import ValidationError

from mongo_outbox._driver import driver_kind
from mongo_outbox._write.aggregates import aggregate_id, encoded_size, type_of
from mongo_outbox._write.layout import Layout
from mongo_outbox._write.plan import Plan
from mongo_outbox._write.updates import (
    check_array_filters,
    check_update,
    check_upsert_filter,
    id_of,
)
from mongo_outbox.errors import InvalidAggregateError, InvalidEventError, UsageError
from mongo_outbox.events import Event
from mongo_outbox.tracing import stamped

_INT64 = 2**63


class Rules:
    """The checks of an outbox over ``db`` whose entries ``layout`` keeps; ``owned`` are the
    fields it owns (the layout's)."""

    def __init__(
        self,
        db: Any,
        layout: Layout,
        aggregate_types: Mapping[str, str],
        owned: frozenset[str],
        internal: frozenset[str] = frozenset(),
    ) -> None:
        self.db = db
        self.layout = layout
        self.aggregate_types = aggregate_types
        self.owned = owned
        self.internal = internal
        """The outbox's own collections: never an aggregate's."""

    def save(
        self,
        session: Any,
        collection: Any,
        document: dict[str, Any],
        events: Sequence[Event],
        expected_version: int | None,
    ) -> Plan:
        name = self._check_collection(collection, session)
        if not isinstance(document, Mapping):
            raise InvalidAggregateError("the document must be a mapping", collection=name)
        _check_expected(expected_version, name)
        if "_id" not in document:
            if expected_version:
                raise InvalidAggregateError(
                    f"a document without _id cannot match expected_version {expected_version}",
                    collection=name,
                )
            if not isinstance(document, MutableMapping):
                raise InvalidAggregateError(
                    f"the document has no _id, and a {type(document).__name__} cannot take the "
                    "one a save gives it: give it an _id",
                    collection=name,
                )
        doc_id = document["_id"] if "_id" in document else ObjectId()
        checked, stamp, given = stamped_events(events, name, doc_id, self.aggregate_types)
        body = {"_id": doc_id} | {k: v for k, v in document.items() if k not in self.owned}
        size = encoded_size(body, collection, "the document")
        entries = self.layout.entries(collection, checked, stamp, size)
        if "_id" not in document:
            # As insert_one does, but only once the save is not refused: a caller that fixes
            # its input and calls again has the dict it had.
            document["_id"] = doc_id
        return Plan(
            "save",
            collection,
            doc_id,
            checked,
            entries,
            stamp,
            expected_version,
            body=body,
            given=given,
        )

    def update(
        self,
        session: Any,
        collection: Any,
        query: Any,
        update: Any,
        events: Sequence[Event],
        upsert: bool,
        expected_version: int | None,
        array_filters: Any = None,
    ) -> Plan:
        name = self._check_collection(collection, session)
        _check_expected(expected_version, name)
        if not isinstance(upsert, bool):
            raise InvalidAggregateError(f"upsert must be a bool, not {upsert!r}", collection=name)
        if expected_version == 0 and not upsert:
            raise InvalidAggregateError(
                "expected_version=0 means the aggregate must not exist yet: pass upsert=True to "
                "create it with this update",
                collection=name,
            )
        doc_id = id_of(query, name)
        # A stored version N > 0 means the document exists: there is nothing to insert (an
        # upsert would insert one at version N + 1).
        upsert = upsert and not expected_version
        if upsert:
            check_upsert_filter(query, self.owned, name)
        change = check_update(update, self.owned, name)
        filters = None
        if array_filters is not None:
            filters = check_array_filters(array_filters, change, name)
        _check_encodable(
            {"q": query, "u": change, "f": filters or []}, collection, "the filter or update"
        )
        checked, stamp, given = stamped_events(events, name, doc_id, self.aggregate_types)
        entries = self.layout.entries(collection, checked, stamp, 0)
        return Plan(
            "update",
            collection,
            doc_id,
            checked,
            entries,
            stamp,
            expected_version,
            query=dict(query),
            update=change,
            upsert=upsert,
            array_filters=filters,
            given=given,
        )

    def delete(
        self,
        session: Any,
        collection: Any,
        query: Any,
        events: Sequence[Event],
        expected_version: int | None,
    ) -> Plan:
        name = self._check_collection(collection, session)
        self.layout.check_supported("delete", name)
        _check_expected(expected_version, name)
        if expected_version == 0:
            raise InvalidAggregateError(
                "expected_version=0 means the aggregate must not exist: there is nothing to delete",
                collection=name,
            )
        doc_id = id_of(query, name)
        _check_encodable({"q": query}, collection, "the filter")
        checked, stamp, _ = stamped_events(events, name, doc_id, self.aggregate_types)
        entries = self.layout.entries(collection, checked, stamp, 0)
        return Plan(
            "delete",
            collection,
            doc_id,
            checked,
            entries,
            stamp,
            expected_version,
            query=dict(query),
        )

    def add(self, session: Any, collection: Any, doc_id: Any, events: Sequence[Event]) -> Plan:
        name = self._check_collection(collection, session)
        self.layout.check_supported("add", name)
        if session is None or not session.in_transaction:
            raise UsageError(
                "add_events records events beside writes you make in your own transaction: call "
                "it with a session inside an open transaction (session.start_transaction)"
            )
        query = {"_id": doc_id}
        _check_encodable({"q": query}, collection, "the aggregate id")
        checked, stamp, _ = stamped_events(events, name, doc_id, self.aggregate_types)
        entries = self.layout.entries(collection, checked, stamp, 0)
        return Plan("add", collection, doc_id, checked, entries, stamp, query=query)

    def _check_collection(self, collection: Any, session: Any) -> str:
        name = getattr(collection, "name", None)
        database = getattr(collection, "database", None)
        if not isinstance(name, str) or database is None:
            raise InvalidAggregateError(
                f"the collection must be a collection of the outbox's database (db.orders), "
                f"not a {type(collection).__name__}"
            )
        # A database, collection or client has each attribute too (a sub-object): not these.
        if session is not None and (
            driver_kind(session) is not None
            or not all(
                hasattr(session, attribute)
                for attribute in ("client", "in_transaction", "has_ended")
            )
        ):
            raise UsageError(
                f"the session must be a session of the outbox's client (or None), not a "
                f"{type(session).__name__}"
            )
        # Clients are compared, not names: a namesake database of another client (or a Motor
        # database beside a PyMongo one) is out of this outbox's and its relay's sight.
        if database.client is not self.db.client or database.name != self.db.name:
            raise InvalidAggregateError(
                f"{database.name}.{name} is not a collection of the outbox's client and "
                f"database {self.db.name}: the relay would never see its events",
                collection=name,
            )
        whose = reserved_collection(name, self.internal)
        if whose:
            raise InvalidAggregateError(
                f"{name} is {whose}, not a collection of aggregates: an aggregate written there "
                "would corrupt it",
                collection=name,
            )
        self.layout.check_target(collection, session)
        if session is not None:
            if session.client is not self.db.client:
                raise InvalidAggregateError(
                    "the session belongs to another client than the outbox", collection=name
                )
            if session.has_ended:
                raise UsageError("the session has ended: start a new one")
        return name


def _check_valid(event: Event) -> None:
    """Refuse an event its constructor would refuse: ``model_copy(update=...)`` and
    ``model_construct`` make events without validating them, and one stored so could never be
    read back to be published (the relay would park it)."""
    if event._made_by_validation:
        return
    try:
        # As Event, what the relay reads it as: a subclass's own validators are for its input.
        Event.model_validate({name: event.__dict__.get(name) for name in Event.model_fields})
    except (ValidationError, ValueError, TypeError) as error:
        given = event.__dict__.get("id")
        raise InvalidEventError(
            f"event {given!r} is invalid (made without validation, e.g. by "
            f"model_copy(update=...) or model_construct): {error}",
            event_id=given if isinstance(given, str) else None,
        ) from error


RELAYS_DEFAULT_COLLECTIONS = frozenset({"outbox_relays", "outbox_relay_members"})
"""Where the relays keep their checkpoints and leases, and a group its members, unless told
otherwise: an aggregate saved there would overwrite a lease or a checkpoint."""


def reserved_collection(name: str, internal: frozenset[str]) -> str | None:
    """Whose collection ``name`` is when it is no place for aggregates: one of ``internal``
    (the outbox's own), the relays' (by their default names) or MongoDB's (``system.*``);
    else ``None``."""
    if name in internal:
        return "one of the outbox's own collections"
    if name in RELAYS_DEFAULT_COLLECTIONS:
        return "one of the relays' own collections"
    if name.startswith("system."):
        return "one of MongoDB's own collections"
    return None


def _check_expected(expected_version: Any, name: str) -> None:
    if expected_version is not None and (
        isinstance(expected_version, bool)
        or not isinstance(expected_version, int)
        or not 0 <= expected_version < _INT64
    ):
        raise InvalidAggregateError(
            f"expected_version must be an int from 0 to 2**63 - 1, not {expected_version!r}",
            collection=name,
        )


def _check_encodable(value: Mapping[str, Any], collection: Any, what: str) -> None:
    # The driver would refuse it only once the write is under way (after an embedded save's
    # event ids were reserved): refuse it first.
    try:
        bson.encode(value, codec_options=collection.codec_options)
    except (InvalidDocument, OverflowError, UnicodeEncodeError, TypeError, ValueError) as error:
        raise InvalidAggregateError(
            f"{what} cannot be sent to MongoDB: {type(error).__name__}: {error}",
            collection=collection.name,
        ) from error


def stamped_events(
    events: Iterable[Event], name: str, doc_id: Any, aggregate_types: Mapping[str, str]
) -> tuple[list[Event], dict[str, Any], tuple[Event, ...]]:
    """The events, checked and carrying the current trace context (``tracing.py``), the
    stamp that makes them the aggregate ``doc_id``'s of collection ``name``, and the caller's own
    Event objects."""
    stamp: dict[str, Any] = {
        "aggregate_type": type_of(aggregate_types, name),
        "aggregate_id": aggregate_id(doc_id, name),
    }
    if isinstance(events, Event):  # a model iterates as its (field, value) pairs
        raise InvalidEventError(
            f"events must be a list of Event, not one Event: write [event] ({events.id})",
            event_id=events.id,
        )
    if isinstance(events, (str, bytes, Mapping)) or not isinstance(events, Iterable):
        raise InvalidEventError(f"events must be a list of Event, not {type(events).__name__}")
    seen: set[str] = set()
    checked = []
    for event in events:
        if not isinstance(event, Event):
            raise InvalidEventError(f"expected an Event, got {type(event).__name__}")
        _check_valid(event)
        if event.id in seen:
            raise InvalidEventError(f"event id {event.id} appears twice", event_id=event.id)
        seen.add(event.id)
        for key, value in stamp.items():
            given = getattr(event, key)
            if given is not None and given != value:
                raise InvalidEventError(
                    f"event {event.id} has {key} {given!r}, but {name} {doc_id!r} "
                    f"publishes as {value!r}",
                    event_id=event.id,
                )
        checked.append(event)
    # Every write API passes here: the one place events take the current trace context.
    return stamped(checked), stamp, tuple(checked)
