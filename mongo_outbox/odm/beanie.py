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
  merged into the update, as Beanie does), the same guard, the document read back and validated
  by its model before the commit, so a result it refuses stores nothing (embedded mode outside a
  transaction has no commit to wait for: its write stands, and a refused read-back is logged,
  not raised).
- ``save_changes`` as ``Document.save_changes`` (``use_state_management``): ``SaveChanges``
  actions around an ``update`` of the fields changed since the document was loaded or saved,
  so that a concurrent write of another field is never put back as this copy loaded it.
- ``replace`` as ``Document.replace``: ``Replace`` actions, the model's fields written over the
  stored document, in one transaction with the read that checks its guards; the outbox's fields
  stay (``save_with_events`` keeps them), where Beanie's own ``replace`` drops the counters.
- ``insert_many``: ``(document, events)`` pairs, inserted in one transaction (all or none).
- ``delete`` as ``Document.delete``: ``Delete`` actions (collection mode only, as for
  ``delete_with_events``).

``insert``, ``save``, ``replace`` and ``insert_many`` take ``link_rule=WriteRules.WRITE``: the
linked documents are saved by Beanie's own ``save`` in the same transaction as the document and
its events. A ``bulk_writer`` is refused (``UsageError``): a ``BulkWriter`` writes outside any
transaction, where no events can go with the documents.

Each takes ``events``, ``session`` and ``expected_version`` as the ``Outbox`` does, and returns its
``Saved``. The fields the outbox owns are never sent from the model; a model field aliased
``_version`` (``version: int = Field(0, alias="_version", exclude=True)``) is loaded by Beanie and
kept up to date here, for ``expected_version``. A model whose own Beanie writes would send the
outbox's fields back (``extra="allow"``, or one of them declared without ``exclude=True``) is
refused with ``ConfigurationError``. A guard the stored ``revision_id`` fails raises
``RevisionConflictError``, which is Beanie's ``RevisionIdWasChanged`` and an ``OutboxError``. In
the caller's transaction, which may yet be aborted, a write leaves the document's
``revision_id``, version and saved state as they were, so that its retry is guarded as the first
try was.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar
from uuid import UUID, uuid4

from beanie import Document, PydanticObjectId
from beanie.exceptions import RevisionIdWasChanged
from beanie.odm.actions import ActionDirections, ActionRegistry, EventTypes
from beanie.odm.fields import LinkTypes, WriteRules
from beanie.odm.operators.update.general import Inc, Set
from beanie.odm.utils.dump import get_dict, get_top_level_nones
from beanie.odm.utils.encoder import Encoder
from beanie.odm.utils.parsing import merge_models
from beanie.odm.utils.update_merge import merge_update_expressions
from pydantic import ValidationError
from pymongo.errors import PyMongoError

from mongo_outbox.errors import (
    AggregateNotFoundError,
    ConcurrencyError,
    ConfigurationError,
    InvalidAggregateError,
    OutboxError,
    UsageError,
    describe,
)
from mongo_outbox.events import Event
from mongo_outbox.outbox import Outbox, Saved

__all__ = ["BeanieOutbox", "RevisionConflictError"]

log = logging.getLogger(__name__)

D = TypeVar("D", bound=Document)
Skip = Sequence[ActionDirections | str] | None
T = TypeVar("T")

# An unguarded replace is made again when another writer came between its read and its write:
# each try lost to a write that stood, so more than a few means a document written without pause.
_REPLACE_TRIES = 5
_LISTS = (
    LinkTypes.LIST,
    LinkTypes.OPTIONAL_LIST,
    LinkTypes.BACK_LIST,
    LinkTypes.OPTIONAL_BACK_LIST,
)


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
        self._checked: set[type[Document]] = set()

    def _check(self, document: Document) -> None:
        """ConfigurationError for a model whose own Beanie writes would send the outbox's
        fields back: one that declares such a field without ``exclude=True``, or one with
        ``extra="allow"`` that loads the undeclared ones as extras. Beanie's ``save()`` of a
        stale copy of it would roll the counters back (its sequences then repeat) and, in
        embedded mode, its pending events. Once per model."""
        model = type(document)
        if model in self._checked:
            return
        owned = self.outbox.owned_fields
        declared = {}
        for name, field in model.model_fields.items():
            key = field.alias or name
            if key in owned:
                if field.exclude is not True:
                    raise ConfigurationError(
                        f"{model.__name__}.{name} is stored as {key}, which the outbox writes "
                        "itself, and Beanie's own writes (save(), replace()) would send it back "
                        f"from a stale copy: declare it Field(..., alias={key!r}, exclude=True)",
                        setting=f"{model.__name__}.{name}",
                    )
                declared[key] = name
        undeclared = sorted(owned - declared.keys())
        if model.model_config.get("extra") == "allow" and undeclared:
            raise ConfigurationError(
                f"{model.__name__} has extra='allow': it loads the outbox's fields "
                f"{', '.join(undeclared)} as extras, and Beanie's own save() of a stale copy "
                "would write them back, rolling the counters back (sequences then repeat) and, "
                "in embedded mode, the pending events. Use extra='ignore' (pydantic's default), "
                "or declare each of them excluded, e.g. "
                f"Field(None, alias={undeclared[0]!r}, exclude=True)",
                setting=f"{model.__name__}.model_config['extra']",
            )
        self._checked.add(model)

    async def insert(
        self,
        document: D,
        events: Sequence[Event],
        *,
        session: Any = None,
        skip_actions: Skip = None,
        link_rule: WriteRules = WriteRules.DO_NOTHING,
        bulk_writer: object = None,
    ) -> Saved:
        """Insert ``document`` (which must not exist yet: ``ConcurrencyError``) with ``events``;
        ``link_rule=WriteRules.WRITE`` saves its linked documents too, in the same transaction."""
        _refuse_bulk_writer(bulk_writer)
        self._check(document)
        await _validate(document)
        await _actions(document, EventTypes.INSERT, ActionDirections.BEFORE, skip_actions)
        revision = uuid4() if document.get_settings().use_revision else None
        doc_id = _new_id(document)

        async def write(session: Any) -> Saved:
            await _write_links(document, session, link_rule)  # first: a link needs their ids
            body = self._stored(document, doc_id, revision)
            return await self.outbox.save_with_events(
                session, _collection(document), body, events, expected_version=0
            )

        saved = await self._linked(write, session, link_rule)
        # Refused, it leaves the document as it was: nothing was written (an insert reads no
        # counters).
        _after_write(document, doc_id, saved, _joined(session), revision)
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
        link_rule: WriteRules = WriteRules.DO_NOTHING,
        bulk_writer: object = None,
    ) -> Saved:
        """Insert or update ``document`` with ``events``, as ``Document.save`` writes it. A
        document stored before (it holds a ``revision_id`` or a version) and deleted meanwhile
        is not re-created: ``AggregateNotFoundError``. ``link_rule=WriteRules.WRITE`` saves its
        linked documents too, in the same transaction."""
        _refuse_bulk_writer(bulk_writer)
        self._check(document)
        await _validate(document)
        await _actions(document, EventTypes.SAVE, ActionDirections.BEFORE, skip_actions)
        await _actions(document, EventTypes.UPDATE, ActionDirections.BEFORE, skip_actions)
        joined = _joined(session)
        doc_id = _new_id(document)
        settings = document.get_settings()
        upsert = not _stored_before(document)

        async def write(session: Any) -> tuple[Saved, UUID | None]:
            await _write_links(document, session, link_rule)  # first: a link needs their ids
            update: dict[str, Any] = {"$set": self._body(document)}
            if not settings.keep_nulls:
                owned = self.outbox.owned_fields
                nones = {key: "" for key in get_top_level_nones(document) if key not in owned}
                if nones:
                    update["$unset"] = nones
            return await self._update(
                document,
                doc_id,
                update,
                events,
                session=session,
                expected_version=expected_version,
                ignore_revision=ignore_revision,
                upsert=upsert,
            )

        saved, revision = await self._linked(write, session, link_rule)
        _after_write(document, doc_id, saved, joined, revision)
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
        bulk_writer: object = None,
    ) -> Saved:
        """Apply Beanie update operators (``Set``, ``Inc``, ``Push``, ... or dicts) to the stored
        ``document`` with ``events``, then read the document back into ``document``."""
        _refuse_bulk_writer(bulk_writer)
        self._check(document)
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
        query = _update_query(document, arguments)
        held = document.revision_id  # the guard of every try, whatever the document holds then

        async def write(session: Any) -> tuple[Saved, UUID | None]:
            return await self._update(
                document,
                document.id,
                copy.deepcopy(query),  # each try adds a revision_id of its own
                events,
                session=session,
                expected_version=expected_version,
                ignore_revision=ignore_revision,
                upsert=False,
                held=held,
            )

        joined = _joined(session)
        if self.outbox.mode == "collection" or joined:
            (saved, revision), fresh = await self._validated(document, write, session)
        else:
            # Embedded mode outside a transaction: one single-document write, which stands
            # once made. The result is read back after it, and a failure there is not raised:
            # a caller who took it for a refusal would write the events again.
            saved, revision = await write(session)
            read, fresh = await _read_back(document, saved, session)
            if not read:
                return saved
        _after_write(document, document.id, saved, joined, revision, fresh)
        await _actions(document, EventTypes.UPDATE, ActionDirections.AFTER, skip_actions)
        return saved

    async def _validated(
        self,
        document: Document,
        write: Callable[[Any], Awaitable[tuple[Saved, UUID | None]]],
        session: Any,
    ) -> tuple[tuple[Saved, UUID | None], Document | None]:
        """``write`` and the document read back and validated by its model, in one
        transaction (``_atomically``). A result the model refuses raises pydantic's
        ``ValidationError`` before the commit, and nothing stands: in your transaction, the
        update and its events, committed, would store what the model cannot load."""
        model = type(document)

        async def attempt(session: Any) -> tuple[tuple[Saved, UUID | None], Document | None]:
            written = await write(session)
            stored = await _collection(document).find_one({"_id": document.id}, session=session)
            return written, None if stored is None else model.model_validate(stored)

        return await self._atomically(session, attempt, (ValidationError,))

    async def _atomically(
        self,
        session: Any,
        attempt: Callable[[Any], Awaitable[T]],
        abort_on: tuple[type[Exception], ...],
    ) -> T:
        """``attempt`` in one transaction: yours, joined (an error of ``abort_on`` aborts it:
        what ``attempt`` wrote before the error must not commit), or one of its own, on
        ``session`` if given, retried as ``with_transaction`` retries."""
        if _joined(session):
            try:
                return await attempt(session)
            except abort_on:
                with contextlib.suppress(PyMongoError):
                    await session.abort_transaction()
                raise
        result: T
        if session is not None:
            result = await session.with_transaction(attempt)
            return result
        async with self.outbox.db.client.start_session() as own:
            result = await own.with_transaction(attempt)
            return result

    async def _linked(
        self, write: Callable[[Any], Awaitable[T]], session: Any, link_rule: WriteRules
    ) -> T:
        """``write``, in one transaction when it saves linked documents too: they and the
        document with its events commit together, or none does."""
        if link_rule is not WriteRules.WRITE:
            return await write(session)
        return await self._atomically(session, write, (Exception,))

    async def save_changes(
        self,
        document: D,
        events: Sequence[Event],
        *,
        session: Any = None,
        expected_version: int | None = None,
        ignore_revision: bool = False,
        skip_actions: Skip = None,
        bulk_writer: object = None,
    ) -> Saved:
        """Write only the fields of ``document`` changed since it was loaded or last saved, with
        ``events``, as ``Document.save_changes`` (the model's ``use_state_management`` must be
        on); a document never saved nor loaded is saved whole (``save``). Nothing changed: the
        events still go, and no field is written."""
        _refuse_bulk_writer(bulk_writer)
        self._check(document)
        settings = document.get_settings()
        if not settings.use_state_management:
            model = type(document).__name__
            raise ConfigurationError(
                f"{model} has no state management: save_changes() needs to know what changed "
                "since the document was loaded (Settings.use_state_management = True)",
                setting=f"{model}.Settings.use_state_management",
            )
        await _validate(document)
        await _actions(document, EventTypes.SAVE_CHANGES, ActionDirections.BEFORE, skip_actions)
        options: dict[str, Any] = {
            "session": session,
            "expected_version": expected_version,
            "ignore_revision": ignore_revision,
            "skip_actions": skip_actions,
        }
        before = document.get_saved_state()
        if before is None:
            saved = await self.save(document, events, **options)
        else:
            owned = self.outbox.owned_fields
            changes = {
                key: value
                for key, value in document.get_changes().items()
                if key != "_id" and key.split(".")[0] not in owned
            }
            update: dict[str, Any] = {"$set": changes}
            if not settings.keep_nulls:
                # Only the fields that became None: Beanie unsets every None field, which would
                # erase a value another writer stored there meanwhile.
                nones = {key: "" for key in get_top_level_nones(document) if key in before}
                if nones:
                    update["$unset"] = nones
            saved = await self.update(document, update, events=events, **options)
        await _actions(document, EventTypes.SAVE_CHANGES, ActionDirections.AFTER, skip_actions)
        return saved

    async def replace(
        self,
        document: D,
        events: Sequence[Event],
        *,
        session: Any = None,
        expected_version: int | None = None,
        ignore_revision: bool = False,
        skip_actions: Skip = None,
        link_rule: WriteRules = WriteRules.DO_NOTHING,
        bulk_writer: object = None,
    ) -> Saved:
        """Replace the stored ``document`` with the model's fields, with ``events``, as
        ``Document.replace``: fields the model does not declare go, the outbox's stay (its
        counters go on, its pending events are kept). A document not stored raises
        ``AggregateNotFoundError``."""
        _refuse_bulk_writer(bulk_writer)
        self._check(document)
        collection = _collection(document)
        if document.id is None:
            raise InvalidAggregateError(
                f"{type(document).__name__} has no id: insert or save it first",
                collection=collection.name,
            )
        await _validate(document)
        await _actions(document, EventTypes.REPLACE, ActionDirections.BEFORE, skip_actions)
        settings = document.get_settings()
        guarded = settings.use_revision and not ignore_revision
        held = document.revision_id
        revision = uuid4() if settings.use_revision else None
        doc_id = document.id

        def conflict() -> RevisionConflictError:
            return RevisionConflictError(
                f"{collection.name} {doc_id!r}: its revision_id is no longer {held}: it was "
                "saved meanwhile",
                collection=collection.name,
                aggregate_id=doc_id,
            )

        async def write(session: Any) -> Saved:
            await _write_links(document, session, link_rule)  # first: a link needs their ids
            query: dict[str, Any] = {"_id": doc_id}
            if guarded:
                query["revision_id"] = _encode(document, held)
            stored = await collection.find_one(query, {"_version": 1}, session=session)
            if stored is None:
                exists = guarded and await collection.find_one(
                    {"_id": doc_id}, {"_id": 1}, session=session
                )
                if exists:
                    raise conflict()
                raise AggregateNotFoundError(
                    f"{collection.name} {doc_id!r} is not stored: replace() writes over a "
                    "stored document (insert or save a new one)",
                    collection=collection.name,
                    aggregate_id=doc_id,
                    exists=False,
                )
            # The version read is the write's guard too: an outbox write between the read and
            # this one is refused, not overwritten, wherever the transaction does not catch it.
            # A document the outbox never wrote has none.
            expected = expected_version
            if expected is None:
                expected = stored.get("_version") or None
            body = self._stored(document, doc_id, revision)
            return await self.outbox.save_with_events(
                session, collection, body, events, expected_version=expected
            )

        # In one transaction, so that the read that checks the guards and the replace are
        # one snapshot: a write between them (Beanie's own included, which leaves the version
        # alone) is a write conflict, and the transaction is tried again.
        abort_on: tuple[type[Exception], ...] = (
            (Exception,) if link_rule is WriteRules.WRITE else ()
        )
        for tries_left in reversed(range(_REPLACE_TRIES)):
            try:
                saved = await self._atomically(session, write, abort_on)
                break
            except ConcurrencyError as error:
                if expected_version is not None or _joined(session) or not tries_left:
                    raise
                if guarded:
                    raise conflict() from error
                # Unguarded, as Beanie's replace: another writer came between the read and the
                # write, and the replace is made again over what it stored.
        _after_write(document, doc_id, saved, _joined(session), revision)
        await _actions(document, EventTypes.REPLACE, ActionDirections.AFTER, skip_actions)
        return saved

    async def insert_many(
        self,
        documents: Sequence[tuple[D, Sequence[Event]]],
        *,
        session: Any = None,
        skip_actions: Skip = None,
        link_rule: WriteRules = WriteRules.DO_NOTHING,
        bulk_writer: object = None,
    ) -> list[Saved]:
        """Insert each ``(document, events)`` pair, in one transaction: every document with its
        events, or none of them (a stored ``_id`` raises ``ConcurrencyError``). Returns the
        ``Saved`` of each, in order."""
        _refuse_bulk_writer(bulk_writer)
        pairs = list(documents)
        for item in pairs:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], Document)):
                raise UsageError(
                    f"insert_many takes (document, events) pairs, not {type(item).__name__}: "
                    "insert_many([(order, [Event(...)]), ...])"
                )
        # Everything that can refuse the batch is checked before its first write.
        for document, _ in pairs:
            self._check(document)
            await _validate(document)
        for document, _ in pairs:
            await _actions(document, EventTypes.INSERT, ActionDirections.BEFORE, skip_actions)
        plans: list[tuple[Document, Sequence[Event], Any, UUID | None]] = []
        seen: set[tuple[str, Any]] = set()
        objects: set[int] = set()
        for document, events in pairs:
            collection = _collection(document)
            doc_id = _new_id(document)
            if id(document) in objects or (collection.full_name, doc_id) in seen:
                raise InvalidAggregateError(
                    f"{collection.name} {doc_id!r} is twice in one insert_many",
                    collection=collection.name,
                )
            objects.add(id(document))
            seen.add((collection.full_name, doc_id))
            revision = uuid4() if document.get_settings().use_revision else None
            plans.append((document, events, doc_id, revision))
        if not plans:
            return []

        async def write(session: Any) -> list[Saved]:
            written = []
            for document, events, doc_id, revision in plans:
                await _write_links(document, session, link_rule)  # first: a link needs their ids
                body = self._stored(document, doc_id, revision)
                written.append(
                    await self.outbox.save_with_events(
                        session, _collection(document), body, events, expected_version=0
                    )
                )
            return written

        saved = await self._atomically(session, write, (Exception,))
        joined = _joined(session)
        for (document, _, doc_id, revision), one in zip(plans, saved, strict=True):
            _after_write(document, doc_id, one, joined, revision)
        for document, _ in pairs:
            await _actions(document, EventTypes.INSERT, ActionDirections.AFTER, skip_actions)
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
        bulk_writer: object = None,
    ) -> Saved:
        """Delete ``document`` with ``events`` (collection mode), as ``Document.delete``."""
        _refuse_bulk_writer(bulk_writer)
        self._check(document)
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

    def _stored(self, document: Document, doc_id: Any, revision: UUID | None) -> dict[str, Any]:
        """The document as an insert or a replace stores it: its ``_id``, the model's fields
        and the new ``revision_id`` (``use_revision``)."""
        body = {"_id": doc_id, **self._body(document)}
        if revision is not None:
            body["revision_id"] = _encode(document, revision)
        return body

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
        held: UUID | None = None,
    ) -> tuple[Saved, UUID | None]:
        """The write, guarded by the ``revision_id`` the document ``held`` (by default the one
        it holds); returns its ``Saved`` and the new ``revision_id`` (None without
        ``use_revision``), which the caller gives the document once the write stands."""
        if held is None:
            held = document.revision_id
        query: dict[str, Any] = {"_id": doc_id}
        guarded = document.get_settings().use_revision and not ignore_revision
        revision = None
        if document.get_settings().use_revision:
            revision = uuid4()
            update.setdefault("$set", {})["revision_id"] = _encode(document, revision)
        if guarded:  # a UUID as Beanie stores it
            query["revision_id"] = _encode(document, held)
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
                    f"{held}: it was saved meanwhile",
                    collection=collection.name,
                    aggregate_id=doc_id,
                ) from error
            raise
        return saved, revision


async def _read_back(
    document: Document, saved: Saved, session: Any
) -> tuple[bool, Document | None]:
    """Whether the stored document could be read after an update that stands (embedded mode,
    outside a transaction), and it, validated by its model (None: deleted meanwhile). When it
    cannot be read or the model refuses it, a warning says so, and the document keeps what it
    held, its ``revision_id`` and its version too: a save guarded by either is a conflict, never
    an overwrite of what was stored."""
    try:
        stored = await _collection(document).find_one({"_id": document.id}, session=session)
        return True, None if stored is None else type(document).model_validate(stored)
    except (PyMongoError, ValidationError) as error:
        log.warning(
            "%s %r: the update and its events are stored (version %s), but the document could "
            "not be read back (%s); it keeps its values, revision_id and version from before",
            type(document).__name__,
            document.id,
            saved.version,
            describe(error),
        )
        return False, None


def _refuse_bulk_writer(bulk_writer: object) -> None:
    if bulk_writer is not None:
        raise UsageError(
            "BeanieOutbox takes no bulk_writer: a BulkWriter sends its operations in one "
            "bulk_write when it closes, outside any transaction, where no document's events can "
            "be written with it. Use insert_many (one transaction), or the writes one by one in "
            "your transaction"
        )


async def _write_links(document: Document, session: Any, link_rule: WriteRules) -> None:
    """Beanie's ``WriteRules.WRITE``: each linked document saved, with its own links, by
    Beanie's own ``save`` on ``session`` (a ``$set`` of its fields, which leaves an outbox's
    fields alone; Beanie's ``replace`` of it would drop them)."""
    if link_rule is not WriteRules.WRITE:
        return
    for info in (document.get_link_fields() or {}).values():
        value = getattr(document, info.field_name)
        linked = value if info.link_type in _LISTS and isinstance(value, list) else [value]
        for one in linked:
            # One at a time: a session's operations in a transaction cannot run at once.
            if isinstance(one, Document):
                await one.save(session=session, link_rule=WriteRules.WRITE)


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


def _joined(session: Any) -> bool:
    """Whether a write on ``session`` joins the caller's transaction."""
    return bool(getattr(session, "in_transaction", False))


def _after_write(
    document: Document,
    doc_id: Any,
    saved: Saved,
    joined: bool,
    revision: UUID | None,
    fresh: Document | None = None,
) -> None:
    """What Beanie does after its own write: the id (a new one is the document's only once it
    is stored), the values read back (``fresh``), the new ``revision_id`` and the saved state
    (state management); and here the outbox's version in a field aliased ``_version``.

    A write that ``joined`` the caller's transaction may yet be aborted: the document keeps its
    ``revision_id``, version and saved state, so that a retry after an abort is guarded as the
    first try was (and a new document is created again)."""
    document.id = doc_id
    kept = {name: getattr(document, name) for name in ["revision_id", *_version_fields(document)]}
    if fresh is not None:
        merge_models(document, fresh)
    if joined:
        for name, value in kept.items():
            setattr(document, name, value)
        return
    if revision is not None:
        document.revision_id = revision
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
