"""Beanie documents saved with their events: ``BeanieOutbox(outbox)``.

Beanie (2.x, on PyMongo's async API) writes a document with its own commands, which an outbox
cannot join with the events' write. So ``BeanieOutbox`` makes the write itself, through the
``Outbox`` (the same rules and storage as ``save_with_events``), and does around it what the
Beanie method of the same name does around its own write:

- ``insert`` as ``Document.insert``: validation (``validate_on_save``), ``Insert`` actions, a
  new ``revision_id`` (``use_revision``); the write is a create (``expected_version=0``).
- ``save`` as ``Document.save``: validation, ``Save`` and ``Update`` actions, and the same write:
  a ``$set`` of the model's fields (``$unset`` of its ``None`` fields unless ``keep_nulls``),
  upserted by ``_id``, guarded by the ``revision_id`` the document holds (``use_revision``,
  unless ``ignore_revision``). Fields the model does not declare, the outbox's among them, stay.
- ``update``, ``set``, ``inc`` as ``Document.update``: ``Update`` actions (changes they make are
  merged into the update, as Beanie does), the same guard, the document read back afterwards.
- ``delete`` as ``Document.delete``: ``Delete`` actions (collection mode only, as for
  ``delete_with_events``).

Each takes ``events``, ``session`` and ``expected_version`` as the ``Outbox`` does, and returns its
``Saved``. The fields the outbox owns are never sent from the model; a model field aliased
``_version`` (``version: int = Field(0, alias="_version", exclude=True)``) is loaded by Beanie and
kept up to date here, for ``expected_version``. A guard the stored ``revision_id`` fails raises
``RevisionConflictError``, which is Beanie's ``RevisionIdWasChanged`` and an ``OutboxError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar
from uuid import uuid4

from beanie import Document, PydanticObjectId
from beanie.exceptions import RevisionIdWasChanged
from beanie.odm.actions import ActionDirections, ActionRegistry, EventTypes
from beanie.odm.operators.update.general import Inc, Set
from beanie.odm.utils.dump import get_dict, get_top_level_nones
from beanie.odm.utils.encoder import Encoder
from beanie.odm.utils.parsing import merge_models
from beanie.odm.utils.update_merge import merge_update_expressions

from mongo_outbox.errors import (
    AggregateNotFoundError,
    InvalidAggregateError,
    InvalidCountersError,
    OutboxError,
)
from mongo_outbox.events import Event
from mongo_outbox.outbox import Outbox, Saved

__all__ = ["BeanieOutbox", "RevisionConflictError"]

D = TypeVar("D", bound=Document)
Skip = Sequence[ActionDirections | str] | None


class RevisionConflictError(OutboxError, RevisionIdWasChanged):
    """The stored document's ``revision_id`` is not the one the document held: someone saved
    it meanwhile. Nothing was written. Caught as Beanie's ``RevisionIdWasChanged`` too."""

    def __init__(self, message: str, *, collection: str, aggregate_id: Any) -> None:
        super().__init__(message)
        self.collection = collection
        self.aggregate_id = aggregate_id


class BeanieOutbox:
    """Saves Beanie documents with their events through ``outbox``.

    Parameters:
        outbox: a ``mongo_outbox.Outbox`` over the database ``init_beanie`` was given (the same
            client): the documents' collections must be its own.
    """

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    async def insert(
        self,
        document: D,
        events: Sequence[Event],
        *,
        session: Any = None,
        skip_actions: Skip = None,
    ) -> Saved:
        """Insert ``document`` (which must not exist yet: ``ConcurrencyError``) with ``events``."""
        await _validate(document)
        await _actions(document, EventTypes.INSERT, ActionDirections.BEFORE, skip_actions)
        settings = document.get_settings()
        previous = document.revision_id
        if settings.use_revision:
            document.revision_id = uuid4()
        doc_id = _new_id(document)
        body = {"_id": doc_id, **self._body(document)}
        try:
            saved = await self.outbox.save_with_events(
                session, _collection(document), body, events, expected_version=0
            )
        except OutboxError as error:
            # Refused, nothing was written: the document keeps the revision the stored one has,
            # so a save of it after a refused insert is not taken for a conflict. (Bad counters
            # are found in what the write returned: it may stand.)
            if not isinstance(error, InvalidCountersError):
                document.revision_id = previous
            raise
        _after_write(document, doc_id, saved)
        await _actions(document, EventTypes.INSERT, ActionDirections.AFTER, skip_actions)
        return saved

    async def save(
        self,
        document: D,
        events: Sequence[Event],
        *,
        session: Any = None,
        expected_version: int | None = None,
        ignore_revision: bool = False,
        skip_actions: Skip = None,
    ) -> Saved:
        """Insert or update ``document`` with ``events``, as ``Document.save`` writes it. A
        document stored before (it holds a ``revision_id`` or a version) and deleted meanwhile
        is not re-created: ``AggregateNotFoundError``."""
        await _validate(document)
        await _actions(document, EventTypes.SAVE, ActionDirections.BEFORE, skip_actions)
        await _actions(document, EventTypes.UPDATE, ActionDirections.BEFORE, skip_actions)
        doc_id = _new_id(document)
        settings = document.get_settings()
        update: dict[str, Any] = {"$set": self._body(document)}
        if not settings.keep_nulls:
            owned = self.outbox.owned_fields
            nones = {key: "" for key in get_top_level_nones(document) if key not in owned}
            if nones:
                update["$unset"] = nones
        saved = await self._update(
            document,
            doc_id,
            update,
            events,
            session=session,
            expected_version=expected_version,
            ignore_revision=ignore_revision,
            upsert=not _stored_before(document),
        )
        _after_write(document, doc_id, saved)
        await _actions(document, EventTypes.UPDATE, ActionDirections.AFTER, skip_actions)
        await _actions(document, EventTypes.SAVE, ActionDirections.AFTER, skip_actions)
        return saved

    async def update(
        self,
        document: D,
        *args: Mapping[Any, Any],
        events: Sequence[Event],
        session: Any = None,
        expected_version: int | None = None,
        ignore_revision: bool = False,
        skip_actions: Skip = None,
    ) -> Saved:
        """Apply Beanie update operators (``Set``, ``Inc``, ``Push``, ... or dicts) to the stored
        ``document`` with ``events``, then read the document back into ``document``."""
        if document.id is None:
            raise InvalidAggregateError(
                f"{type(document).__name__} has no id: insert or save it first",
                collection=_collection(document).name,
            )
        arguments: list[Any] = list(args)
        if _has_actions(document, EventTypes.UPDATE, ActionDirections.BEFORE, skip_actions):
            # As Beanie does: what the actions change joins the update.
            before = get_dict(document, to_db=True, keep_nulls=True)
            await _actions(document, EventTypes.UPDATE, ActionDirections.BEFORE, skip_actions)
            after = get_dict(document, to_db=True, keep_nulls=True)
            changes = {
                key: value
                for key, value in after.items()
                if key not in ("_id", "revision_id") and before.get(key) != value
            }
            if changes:
                arguments = merge_update_expressions(
                    arguments, changes, strategy=document.get_settings().action_conflict_resolution
                )
        previous = document.revision_id
        saved = await self._update(
            document,
            document.id,
            _update_query(document, arguments),
            events,
            session=session,
            expected_version=expected_version,
            ignore_revision=ignore_revision,
            upsert=False,
        )
        try:
            stored = await _collection(document).find_one({"_id": document.id}, session=session)
            if stored is not None:
                merge_models(document, type(document).model_validate(stored))
        except BaseException:
            # The update and its events stand, but the document does not hold them: with the
            # new revision its next save would pass the guard and overwrite them. With the old
            # one, that save is a conflict.
            document.revision_id = previous
            raise
        _after_write(document, document.id, saved)
        await _actions(document, EventTypes.UPDATE, ActionDirections.AFTER, skip_actions)
        return saved

    async def set(
        self, document: D, expression: Mapping[Any, Any], events: Sequence[Event], **kwargs: Any
    ) -> Saved:
        """``update(document, Set(expression), events=events)``, as ``Document.set``."""
        operator = Set(dict(expression))  # type: ignore[no-untyped-call]
        return await self.update(document, operator, events=events, **kwargs)

    async def inc(
        self, document: D, expression: Mapping[Any, Any], events: Sequence[Event], **kwargs: Any
    ) -> Saved:
        """``update(document, Inc(expression), events=events)``, as ``Document.inc``."""
        operator = Inc(dict(expression))  # type: ignore[no-untyped-call]
        return await self.update(document, operator, events=events, **kwargs)

    async def delete(
        self,
        document: D,
        events: Sequence[Event],
        *,
        session: Any = None,
        expected_version: int | None = None,
        skip_actions: Skip = None,
    ) -> Saved:
        """Delete ``document`` with ``events`` (collection mode), as ``Document.delete``."""
        await _actions(document, EventTypes.DELETE, ActionDirections.BEFORE, skip_actions)
        saved = await self.outbox.delete_with_events(
            session,
            _collection(document),
            {"_id": document.id},
            events,
            expected_version=expected_version,
        )
        await _actions(document, EventTypes.DELETE, ActionDirections.AFTER, skip_actions)
        return saved

    def _body(self, document: Document) -> dict[str, Any]:
        """The model's fields as Beanie stores them, without ``_id`` and the outbox's fields.

        The ``_id`` goes to the outbox as it is, a UUID too: Beanie would encode it as a BSON
        Binary, which the outbox does not take for an aggregate id; it encodes the UUID by the
        client's ``uuidRepresentation``, which must then be ``"standard"``, as Beanie's is."""
        settings = document.get_settings()
        body: dict[str, Any] = get_dict(document, to_db=True, keep_nulls=settings.keep_nulls)
        owned = self.outbox.owned_fields
        return {key: value for key, value in body.items() if key != "_id" and key not in owned}

    async def _update(
        self,
        document: Document,
        doc_id: Any,
        update: dict[str, Any],
        events: Sequence[Event],
        *,
        session: Any,
        expected_version: int | None,
        ignore_revision: bool,
        upsert: bool,
    ) -> Saved:
        query: dict[str, Any] = {"_id": doc_id}
        guarded = document.get_settings().use_revision and not ignore_revision
        if guarded:
            query["revision_id"] = document.revision_id
        if document.get_settings().use_revision:
            revision = uuid4()
            update.setdefault("$set", {})["revision_id"] = _encode(document, revision)
        if guarded:  # a UUID as Beanie stores it
            query["revision_id"] = _encode(document, document.revision_id)
        collection = _collection(document)
        try:
            saved = await self.outbox.update_with_events(
                session,
                collection,
                query,
                update,
                events,
                upsert=upsert,
                expected_version=expected_version,
            )
        except AggregateNotFoundError as error:
            # Not read again here: in the caller's transaction, the refused write has aborted it.
            if guarded and error.exists:
                raise RevisionConflictError(
                    f"{collection.name} {doc_id!r}: its revision_id is no longer "
                    f"{document.revision_id}: it was saved meanwhile",
                    collection=collection.name,
                    aggregate_id=doc_id,
                ) from error
            raise
        if document.get_settings().use_revision:
            document.revision_id = revision
        return saved


def _collection(document: Document) -> Any:
    return document.get_pymongo_collection()


def _new_id(document: Document) -> Any:
    """The document's id, or a new ObjectId for a model whose id is Beanie's default type."""
    if document.id is not None:
        return document.id
    if type(document).model_fields["id"].annotation in (PydanticObjectId | None, PydanticObjectId):
        return PydanticObjectId()
    raise InvalidAggregateError(
        f"{type(document).__name__} has no id, and its id type is not an ObjectId the outbox can "
        "make: set the id before saving",
        collection=_collection(document).name,
    )


async def _validate(document: Document) -> None:
    """Beanie's ``validate_self``, which rebuilds the model and so drops the fields its dump
    leaves out back to their defaults: the ``revision_id`` (Beanie's own save guards with a
    copy kept apart) and the version aliased ``_version``. Without them the guard would refuse
    every save, and a refused save would leave the document at version 0."""
    kept = ["revision_id", *_version_fields(document)]
    values = {name: getattr(document, name) for name in kept}
    try:
        await document.validate_self()
    finally:
        for name, value in values.items():
            setattr(document, name, value)


def _version_fields(document: Document) -> list[str]:
    return [n for n, f in type(document).model_fields.items() if f.alias == "_version"]


def _stored_before(document: Document) -> bool:
    """Whether ``document`` was inserted or loaded: Beanie gave it a ``revision_id``, or the
    outbox a version. A save of one deleted meanwhile must not re-create it (its sequence
    would start again at 1, and consumers drop what they take for old events)."""
    if document.get_settings().use_revision and document.revision_id is not None:
        return True
    return any(getattr(document, name, 0) for name in _version_fields(document))


def _after_write(document: Document, doc_id: Any, saved: Saved) -> None:
    """What Beanie does after its own write: the id (a new one is the document's only once it
    is stored), the saved state (state management), and here the outbox's version in a field
    aliased ``_version``."""
    document.id = doc_id
    for name in _version_fields(document):
        setattr(document, name, saved.version)
    document._save_state()


def _update_query(document: Document, arguments: list[Any]) -> dict[str, Any]:
    """Beanie's update expressions as one update document, encoded as Beanie encodes them."""
    query: dict[str, Any] = {}
    for expression in arguments:
        part = getattr(expression, "query", expression)
        if not isinstance(part, Mapping):
            raise InvalidAggregateError(
                f"{expression!r} is not an update operator: an update pipeline goes to "
                "Outbox.update_with_events",
                collection=_collection(document).name,
            )
        for operator, fields in part.items():
            query.setdefault(operator, {}).update(fields)
    encoded: dict[str, Any] = _encode(document, query)
    return encoded


def _encode(document: Document, value: Any) -> Any:
    encoders = document.get_bson_encoders()  # type: ignore[no-untyped-call]
    return Encoder(custom_encoders=encoders).encode(value)


def _has_actions(
    document: Document, event: EventTypes, direction: ActionDirections, skip: Skip
) -> bool:
    return direction not in (skip or []) and bool(
        ActionRegistry.get_action_list(type(document), event, direction)
    )


async def _actions(
    document: Document, event: EventTypes, direction: ActionDirections, skip: Skip
) -> None:
    await ActionRegistry.run_actions(
        document, event_type=event, action_direction=direction, exclude=list(skip or [])
    )
