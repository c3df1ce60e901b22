"""MongoEngine documents saved with their events: ``MongoEngineOutbox(outbox)``, on the sync API.

MongoEngine writes with its own commands on PyMongo's ``MongoClient``, which an outbox cannot
join with the events' write. So ``MongoEngineOutbox`` makes the write itself through a
``mongo_outbox.sync.Outbox`` (the same rules and storage as ``save_with_events``) and does around
it what MongoEngine's method of the same name does around its own:

- ``save`` as ``Document.save``: ``pre_save``, validation (``clean`` included),
  ``pre_save_post_validation`` and ``post_save`` with ``created``. A new document is inserted,
  or replaced by ``_id`` (``save_with_events``); a loaded one gets the ``$set``/``$unset`` of its
  changed fields, guarded by ``save_condition`` as MongoEngine guards it. Unlike MongoEngine, a
  loaded document deleted meanwhile is not re-created from its changed fields alone: the save
  raises ``AggregateNotFoundError``. In the caller's transaction the document stays new, or keeps
  its changed fields, and keeps its version, until a save outside one: the transaction may be
  aborted. ``force_insert=True`` inserts as MongoEngine's does: a document whose ``_id`` is
  stored already is refused with ``ConcurrencyError``, and no event is written.
  ``write_concern`` (MongoEngine's dict, ``{"w": "majority"}``) goes to the server: on the commit
  of the save's own transaction (collection mode), on the write itself (embedded mode). It
  cannot be given with a ``session``: a write in a transaction commits with the transaction's
  write concern, and a session's own transactions take the session's defaults; nor can an
  unacknowledged one (``w=0``), which would leave the save unable to tell what it wrote.
- ``modify`` as ``Document.modify``: Django-style update keywords (``set__status="paid"``,
  ``inc__total=5``, ``push__lines="pen"``) and a ``query`` that must hold too, then the document
  reloaded from what was stored (but its version, in the caller's transaction). MongoEngine
  sends no signal for it, nor does this.
- ``delete`` as ``Document.delete``: ``pre_delete`` and ``post_delete`` (collection mode only, as
  for ``delete_with_events``).

Each takes ``events``, ``session`` (a PyMongo ``ClientSession`` of MongoEngine's connection, or
None) and ``expected_version`` as the outbox does, and returns its ``Saved``. The fields the
outbox owns are never sent from the model, and a model needs ``meta = {"strict": False}`` to load
a document that holds them (MongoEngine refuses undeclared fields otherwise). A field stored as
``_version`` (``version = IntField(db_field="_version", default=0)``) is loaded by MongoEngine
and kept up to date here, for ``expected_version``. A failed ``save_condition`` raises
``SaveConditionConflictError``: MongoEngine's ``SaveConditionError`` and an ``OutboxError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from bson import ObjectId
from mongoengine import Document, ObjectIdField, signals
from mongoengine.errors import InvalidDocumentError, SaveConditionError
from mongoengine.queryset import transform
from pymongo.client_session_shared import TransactionOptions
from pymongo.write_concern import WriteConcern

from mongo_outbox.errors import (
    AggregateNotFoundError,
    InvalidAggregateError,
    OutboxError,
    UsageError,
)
from mongo_outbox.events import Event
from mongo_outbox.outbox import Saved
from mongo_outbox.sync import Outbox

__all__ = ["MongoEngineOutbox", "SaveConditionConflictError"]

D = TypeVar("D", bound=Document)


class SaveConditionConflictError(OutboxError, SaveConditionError):  # type: ignore[misc]
    """The stored document does not satisfy ``save_condition`` (or ``modify``'s ``query``): it
    changed meanwhile. Nothing was written. Caught as MongoEngine's ``SaveConditionError`` too."""

    def __init__(self, message: str, *, collection: str, aggregate_id: Any) -> None:
        super().__init__(message)
        self.collection = collection
        self.aggregate_id = aggregate_id


class MongoEngineOutbox:
    """Saves MongoEngine documents with their events through ``outbox``.

    Parameters:
        outbox: a ``mongo_outbox.sync.Outbox`` over MongoEngine's database
            (``mongoengine.get_db(alias)``, the same client): the documents' collections must be
            its own.
    """

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    def save(
        self,
        document: D,
        events: Sequence[Event],
        *,
        session: Any = None,
        expected_version: int | None = None,
        validate: bool = True,
        clean: bool = True,
        save_condition: Mapping[str, Any] | None = None,
        signal_kwargs: Mapping[str, Any] | None = None,
        force_insert: bool = False,
        write_concern: Mapping[str, Any] | None = None,
    ) -> Saved:
        """Insert or update ``document`` with ``events``, as ``Document.save`` writes it;
        ``force_insert`` refuses an ``_id`` stored already (``ConcurrencyError``)."""
        kwargs = dict(signal_kwargs or {})
        cls = type(document)
        if document._meta.get("abstract"):
            raise InvalidDocumentError("Cannot save an abstract document.")
        if force_insert and expected_version not in (None, 0):
            raise UsageError(
                f"force_insert=True inserts (expected_version=0), and expected_version="
                f"{expected_version} expects a stored document: give one or the other"
            )
        concern = _write_concern(write_concern, session)
        signals.pre_save.send(cls, document=document, **kwargs)
        if validate:
            document.validate(clean=clean)
        doc_id = document.to_mongo(fields=[document._meta["id_field"]])
        created = "_id" not in doc_id or document._created or force_insert
        signals.pre_save_post_validation.send(cls, document=document, created=created, **kwargs)
        body = self._body(document.to_mongo())
        collection = cls._get_collection()
        own = None
        if concern is not None:
            collection = collection.with_options(write_concern=concern)
            own = self._session_for(concern)
        try:
            saved = self._save(
                document,
                body,
                collection,
                events,
                own or session,
                created,
                force_insert,
                expected_version,
                save_condition,
            )
        finally:
            if own is not None:
                own.end_session()
        new = document._created
        document[document._meta["id_field"]] = document._fields[
            document._meta["id_field"]
        ].to_python(saved.id)
        joined = getattr(session, "in_transaction", False)
        if not joined:
            _set_version(document, saved)
        signals.post_save.send(cls, document=document, created=created, **kwargs)
        if joined:
            # In the caller's transaction the write may yet be aborted: until it commits, the
            # document keeps what it would send (setting its id took it for stored) and its
            # version, so a save after an abort creates a new one again, sends a loaded one's
            # changes again, and is guarded as the first try was.
            document._created = new
        else:
            document._clear_changed_fields()
            document._created = False
        return saved

    def _session_for(self, concern: WriteConcern) -> Any:
        """A session whose transactions commit with ``concern`` (collection mode: the outbox
        runs the save in a transaction of it), or None where the write is one write that
        carries ``concern`` itself (embedded mode)."""
        if self.outbox.mode != "collection":
            return None
        options = TransactionOptions(write_concern=concern)
        return self.outbox.db.client.start_session(default_transaction_options=options)

    def _save(
        self,
        document: Document,
        body: dict[str, Any],
        collection: Any,
        events: Sequence[Event],
        session: Any,
        created: bool,
        force_insert: bool,
        expected_version: int | None,
        save_condition: Mapping[str, Any] | None,
    ) -> Saved:
        cls = type(document)
        if created:
            if "_id" not in body:
                body["_id"] = _new_id(document, collection)
            if force_insert:
                # MongoEngine's insert fails on a stored _id; a replace here would take it over.
                expected_version = 0
            return self.outbox.save_with_events(
                session, collection, body, events, expected_version=expected_version
            )
        else:
            updates, removals = document._delta()
            update: dict[str, Any] = {}
            if updates := self._body(updates):
                update["$set"] = updates
            if removals := self._body(removals):
                update["$unset"] = removals
            query: dict[str, Any] = {}
            if save_condition is not None:
                query = transform.query(cls, **save_condition)
            query["_id"] = body["_id"]
            if not update:
                # Nothing changed, and the events still go: no field is written (MongoEngine's
                # own save writes nothing), so what another writer stored meanwhile stays.
                update = {"$set": {}}
            return self._update(
                document, query, update, events, session, expected_version, collection
            )

    def modify(
        self,
        document: D,
        events: Sequence[Event],
        *,
        query: Mapping[str, Any] | None = None,
        session: Any = None,
        expected_version: int | None = None,
        **update: Any,
    ) -> Saved:
        """Apply Django-style ``update`` keywords to the stored ``document`` with ``events``,
        only while ``query`` holds too, then reload ``document`` from what was stored."""
        cls = type(document)
        if document.pk is None:
            raise InvalidDocumentError("The document does not have a primary key.")
        condition: dict[str, Any] = transform.query(cls, **dict(query or {}))
        condition["_id"] = document.to_mongo(fields=[document._meta["id_field"]])["_id"]
        raw = transform.update(cls, **update)
        saved = self._update(document, condition, raw, events, session, expected_version)
        stored = cls._get_collection().find_one({"_id": condition["_id"]}, session=session)
        # In the caller's transaction, which may yet be aborted, the version stays: a modify
        # after an abort is guarded as the first try was.
        kept = _version_fields(document) if getattr(session, "in_transaction", False) else []
        if stored is not None:
            fresh = cls._from_son(stored)
            for field in document._fields_ordered:
                if field not in kept:
                    setattr(document, field, document._reload(field, fresh[field]))
        if not kept:
            _set_version(document, saved)
        document._clear_changed_fields()
        document._created = False
        return saved

    def delete(
        self,
        document: D,
        events: Sequence[Event],
        *,
        session: Any = None,
        expected_version: int | None = None,
        signal_kwargs: Mapping[str, Any] | None = None,
    ) -> Saved:
        """Delete ``document`` with ``events`` (collection mode), as ``Document.delete``."""
        kwargs = dict(signal_kwargs or {})
        cls = type(document)
        if document.pk is None:
            raise InvalidDocumentError("The document does not have a primary key.")
        signals.pre_delete.send(cls, document=document, **kwargs)
        doc_id = document.to_mongo(fields=[document._meta["id_field"]])["_id"]
        saved = self.outbox.delete_with_events(
            session,
            cls._get_collection(),
            {"_id": doc_id},
            events,
            expected_version=expected_version,
        )
        signals.post_delete.send(cls, document=document, **kwargs)
        return saved

    def _body(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """``fields`` without the outbox's own: they are never taken from the model."""
        owned = self.outbox.owned_fields
        return {key: value for key, value in fields.items() if key.split(".")[0] not in owned}

    def _update(
        self,
        document: Document,
        query: dict[str, Any],
        update: dict[str, Any],
        events: Sequence[Event],
        session: Any,
        expected_version: int | None,
        collection: Any = None,
    ) -> Saved:
        if collection is None:
            collection = type(document)._get_collection()
        try:
            return self.outbox.update_with_events(
                session, collection, query, update, events, expected_version=expected_version
            )
        except AggregateNotFoundError as error:
            if len(query) > 1 and error.exists:
                raise SaveConditionConflictError(
                    f"{collection.name} {query['_id']!r} does not satisfy the condition {query!r}",
                    collection=collection.name,
                    aggregate_id=query["_id"],
                ) from error
            raise


def _write_concern(write_concern: Mapping[str, Any] | None, session: Any) -> WriteConcern | None:
    """MongoEngine's ``write_concern`` dict as PyMongo's, refused beside a ``session``."""
    if not write_concern:
        return None
    if session is not None:
        raise UsageError(
            "write_concern cannot be given with a session: a write in your transaction commits "
            "with its write concern (session.start_transaction(write_concern=...)), and a "
            "session's own transactions with its default_transaction_options"
        )
    concern = WriteConcern(**write_concern)
    if not concern.acknowledged:
        # Unacknowledged, the save could not tell whether the document and its events were
        # written, nor at which version; and a transaction refuses it.
        raise UsageError(
            f"write_concern={dict(write_concern)!r} is unacknowledged: a save with events must "
            "know it was written (w=1 or more, or 'majority')"
        )
    return concern


def _new_id(document: Document, collection: Any) -> Any:
    """A new ObjectId for a model whose primary key is MongoEngine's default ``ObjectIdField``."""
    if isinstance(document._fields[document._meta["id_field"]], ObjectIdField):
        return ObjectId()
    raise InvalidAggregateError(
        f"{type(document).__name__} has no primary key, and its type is not an ObjectId the "
        "outbox can make: set it before saving",
        collection=collection.name,
    )


def _version_fields(document: Document) -> list[str]:
    """The fields stored as ``_version``."""
    return [name for name, field in document._fields.items() if field.db_field == "_version"]


def _set_version(document: Document, saved: Saved) -> None:
    """The outbox's version in the field stored as ``_version``, if the model has one."""
    for name in _version_fields(document):
        document._data[name] = saved.version
