"""Django models on MongoDB's Django backend saved with their events: ``DjangoOutbox(outbox)``.

``django-mongodb-backend`` writes a model with its own commands (``insert_many`` for a new row,
an ``update_one`` pipeline for a loaded one), which an outbox cannot join with the events'
write, and its save leaves no room for the counters the outbox keeps on the document. So
``DjangoOutbox`` makes the write itself through a ``mongo_outbox.sync.Outbox`` (the same rules
and storage as ``save_with_events``) and does around it what ``Model.save()`` does around its
own, in Django's order:

- ``save``: ``full_clean()`` first (Django's own ``save()`` leaves validation to forms and the
  caller; ``validate=False`` does too), ``pre_save``, each field's ``pre_save`` (``auto_now``,
  ``auto_now_add``) and ``get_db_prep_save`` as the backend prepares it, then one write: a new
  model (``_state.adding``, no pk, or ``force_insert``) is inserted by ``save_with_events``, a
  loaded one gets the ``$set`` of its fields (``update_fields`` only, when given) by
  ``update_with_events``; then ``post_save`` with ``created``, ``update_fields``, ``raw`` and
  ``using``. A loaded model whose document is gone is inserted again, as Django does, unless
  ``force_update`` or ``update_fields`` (then ``AggregateNotFoundError``).
- ``delete``: ``pre_delete``, ``delete_with_events`` (collection mode only), ``post_delete``.

The write joins the transaction of ``django_mongodb_backend.transaction.atomic()`` when the
connection is in one (``connection.session``), so what else the block writes commits or aborts
with the events; outside one, the outbox runs a transaction of its own (collection mode) or makes
one write (embedded mode). Django's own ``django.db.transaction.atomic()`` is a no-op on this
backend (``supports_transactions = False``): inside it, nothing is joined. A model field stored
as ``_version`` (``IntegerField(db_column="_version", default=0, editable=False)``) is loaded by
Django and set here after each write, on the block's commit when it joined one (through the
backend's ``on_commit``), so that a retry after a rollback expects the version it had.

Misuse raises an ``OutboxError`` before anything is written: ``InvalidAggregateError`` for a
model of a database whose backend is not MongoDB's, a multi-table inheritance child (its parents'
documents would be separate writes), a new model whose primary key is not an ``ObjectIdAutoField``
and was not set, and a ``delete`` of a model without a primary key.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from bson import ObjectId
from django.db import DEFAULT_DB_ALIAS, connections, router
from django.db.models import Model, signals
from django_mongodb_backend.fields import ObjectIdAutoField

from mongo_outbox.errors import AggregateNotFoundError, ConfigurationError, InvalidAggregateError
from mongo_outbox.events import Event
from mongo_outbox.outbox import Saved
from mongo_outbox.sync import Outbox

__all__ = ["DjangoOutbox"]

VENDOR = "mongodb"  # django-mongodb-backend's DatabaseWrapper.vendor


class DjangoOutbox:
    """Saves Django models with their events through ``outbox``.

    Parameters:
        outbox: a ``mongo_outbox.sync.Outbox`` over the backend's database
            (``django.db.connections[alias].database``, the same ``MongoClient``): the models'
            collections must be its own.
    """

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    @classmethod
    def for_database(cls, alias: str = DEFAULT_DB_ALIAS, **settings: Any) -> DjangoOutbox:
        """A ``DjangoOutbox`` over the database of ``connections[alias]``; ``settings`` are the
        ``Outbox``'s (``mode``, ``collections``, ...)."""
        connection = connections[alias]
        if connection.vendor != VENDOR:
            raise ConfigurationError(
                f"the database {alias!r} is served by the {connection.vendor} backend: "
                "DjangoOutbox writes through django-mongodb-backend only",
                setting="alias",
            )
        return cls(Outbox(getattr(connection, "database"), **settings))  # noqa: B009

    def save(
        self,
        instance: Model,
        events: Sequence[Event],
        *,
        using: str | None = None,
        expected_version: int | None = None,
        validate: bool = True,
        force_insert: bool = False,
        force_update: bool = False,
        update_fields: Iterable[str] | None = None,
    ) -> Saved:
        """Insert or update ``instance`` with ``events``, as ``instance.save()`` writes it."""
        origin = type(instance)
        # A proxy model saves its concrete model's table.
        meta = (origin._meta.concrete_model or origin)._meta
        connection = self._connection(instance, using)
        table = meta.db_table
        if meta.parents:
            raise InvalidAggregateError(
                f"{origin.__name__} inherits fields from other tables "
                f"({sorted(p.__name__ for p in meta.parents)}): its save is several writes, "
                "not one document with its events",
                collection=table,
            )
        if force_insert and (force_update or update_fields):
            raise InvalidAggregateError(
                "Cannot force both insert and updating in model saving.", collection=table
            )
        fields = frozenset(update_fields) if update_fields is not None else None
        if fields is not None:
            names = {f.name for f in meta.concrete_fields} | {
                f.attname for f in meta.concrete_fields
            }
            if unknown := sorted(fields - names):
                raise InvalidAggregateError(
                    f"update_fields names fields {origin.__name__} does not have: {unknown}",
                    collection=table,
                )
        pk_field = meta.pk
        if instance.pk is None and not isinstance(pk_field, ObjectIdAutoField):
            raise InvalidAggregateError(
                f"{origin.__name__} has no primary key, and its type is not an ObjectId the "
                "outbox can make: set it before saving",
                collection=table,
            )
        if validate:
            instance.full_clean()
        alias = connection.alias
        signals.pre_save.send(
            sender=origin, instance=instance, raw=False, using=alias, update_fields=fields
        )
        session = _session(connection)
        collection = connection.database[table]
        saved: Saved | None = None
        adding = instance._state.adding
        # Django goes straight to an insert when the row is new: no pk, or a pk it made itself.
        insert = force_insert or instance.pk is None or (adding and pk_field.has_default())
        if not insert:
            body = self._body(instance, connection, meta.local_concrete_fields, fields, add=False)
            pk = pk_field.get_db_prep_save(instance.pk, connection=connection)
            try:
                saved = self.outbox.update_with_events(
                    session,
                    collection,
                    {"_id": pk},
                    {"$set": body},
                    events,
                    expected_version=expected_version,
                )
            except AggregateNotFoundError:
                if force_update or fields is not None:
                    raise
                # The document is gone: Django's save inserts the row again.
        created = saved is None
        if saved is None:
            # A new pk is the model's once the insert succeeds, as Django's: a refused save
            # leaves the model as it was.
            pk_value = ObjectId() if instance.pk is None else instance.pk
            body = self._body(instance, connection, meta.local_concrete_fields, None, add=True)
            body["_id"] = pk_field.get_db_prep_save(pk_value, connection=connection)
            # An insert, as Django's (which raises IntegrityError on a stored pk): the outbox's
            # create refuses a stored _id with ConcurrencyError, and needs no findAndModify.
            create = 0 if expected_version is None else expected_version
            saved = self.outbox.save_with_events(
                session, collection, body, events, expected_version=create
            )
            setattr(instance, pk_field.attname, pk_value)
        version = saved.version
        if session is None:
            _set_version(instance, meta.local_concrete_fields, version)
        else:
            # The caller's transaction may yet be aborted: the model takes the new version on
            # its commit, and keeps the one its retry must expect on an abort.
            connection.on_commit(
                lambda: _set_version(instance, meta.local_concrete_fields, version)
            )
        instance._state.db = alias
        instance._state.adding = False
        signals.post_save.send(
            sender=origin,
            instance=instance,
            created=created,
            update_fields=fields,
            raw=False,
            using=alias,
        )
        return saved

    def delete(
        self,
        instance: Model,
        events: Sequence[Event],
        *,
        using: str | None = None,
        expected_version: int | None = None,
    ) -> Saved:
        """Delete ``instance`` with ``events`` (collection mode), as ``instance.delete()``."""
        origin = type(instance)
        meta = (origin._meta.concrete_model or origin)._meta
        connection = self._connection(instance, using)
        if instance.pk is None:
            raise InvalidAggregateError(
                f"{origin.__name__} object can't be deleted because its "
                f"{meta.pk.attname} attribute is set to None.",
                collection=meta.db_table,
            )
        if related := [r.get_accessor_name() for r in meta.related_objects]:
            # Django's delete() collects and deletes or updates these first, each a write of
            # its own; one document with its events cannot hold them.
            raise InvalidAggregateError(
                f"{origin.__name__} has related objects ({', '.join(map(str, related))}) that "
                "Django's delete() would cascade to: delete them first",
                collection=meta.db_table,
            )
        alias = connection.alias
        signals.pre_delete.send(sender=origin, instance=instance, using=alias, origin=instance)
        pk = meta.pk.get_db_prep_save(instance.pk, connection=connection)
        saved = self.outbox.delete_with_events(
            _session(connection),
            connection.database[meta.db_table],
            {"_id": pk},
            events,
            expected_version=expected_version,
        )
        signals.post_delete.send(sender=origin, instance=instance, using=alias, origin=instance)
        setattr(instance, meta.pk.attname, None)
        return saved

    def _connection(self, instance: Model, using: str | None) -> Any:
        """The backend's connection the model is written through: refused unless MongoDB's."""
        alias = (
            using
            or instance._state.db
            or router.db_for_write(type(instance), instance=instance)
            or DEFAULT_DB_ALIAS
        )
        connection = connections[alias]
        if connection.vendor != VENDOR:
            raise InvalidAggregateError(
                f"{type(instance).__name__} is saved to the database {alias!r}, whose backend "
                f"is {connection.vendor}: DjangoOutbox writes to django-mongodb-backend only",
                collection=type(instance)._meta.db_table,
            )
        return connection

    def _body(
        self,
        instance: Model,
        connection: Any,
        fields: Iterable[Any],
        only: Collection[str] | None,
        *,
        add: bool,
    ) -> dict[str, Any]:
        """The document's fields as the backend prepares them, without the pk and the
        outbox's own fields (never taken from the model)."""
        owned = self.outbox.owned_fields
        body: dict[str, Any] = {}
        for field in fields:
            if field.primary_key or getattr(field, "generated", False):
                continue
            if field.column in owned:
                continue
            if only is not None and field.name not in only and field.attname not in only:
                continue
            value = field.pre_save(instance, add)
            if hasattr(value, "resolve_expression"):
                raise InvalidAggregateError(
                    f"{field.name} is set to the expression {value!r}: the outbox writes values, "
                    "not expressions the database computes (refresh the model, then set it)",
                    collection=type(instance)._meta.db_table,
                )
            body[field.column] = field.get_db_prep_save(value, connection=connection)
        return body


def _session(connection: Any) -> Any:
    """The session of the backend's ``atomic()`` block the connection is in, or None."""
    if getattr(connection, "in_atomic_block_mongo", False):
        return connection.session
    return None


def _set_version(instance: Model, fields: Iterable[Any], version: int) -> None:
    """The outbox's version in the field stored as ``_version``, if the model has one."""
    for field in fields:
        if field.column == "_version":
            setattr(instance, field.attname, version)
