"""ODMantic instances saved with their events: ``ODManticOutbox(engine, outbox)``.

ODMantic's ``AIOEngine.save`` writes an instance with its own command (on Motor), which an
outbox cannot join with the events' write. So ``ODManticOutbox.save`` makes the same write
through the ``Outbox``: the ``$set`` of the fields ODMantic would send (those modified since the
last save, and the mutable ones), upserted by the primary key, with the counters and entries of
``update_with_events``. An instance with none to send writes no field (its events still go).
Only a new instance is created: one loaded, then deleted meanwhile, raises
``AggregateNotFoundError``.
``delete`` is ``delete_with_events`` (collection mode only).

ODMantic has no event hooks and no revision field; its validation is pydantic's, at construction
and assignment, so an invalid instance never reaches a save. It ignores fields a model does not
declare, so it loads documents holding the outbox's fields, and its own ``save`` (a ``$set``)
leaves them where they are. A field stored as ``_version`` (``version: int =
Field(0, key_name="_version")``) is loaded by ODMantic and kept up to date here, for
``expected_version``, without being marked modified (after a save outside the caller's
transaction: in it, the instance keeps its modified fields and version for a retry). Referenced
instances are not saved here: save them first, with the engine, in the same session if they must
commit together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from odmantic import AIOEngine, Model

from mongo_outbox.events import Event
from mongo_outbox.outbox import Outbox, Saved

__all__ = ["ODManticOutbox"]


class ODManticOutbox:
    """Saves ODMantic instances with their events through ``outbox``.

    Parameters:
        engine: the application's ``AIOEngine``: its database names the instances' collections.
        outbox: a ``mongo_outbox.Outbox`` over ``engine.database`` (the engine's Motor client):
            the collections must be its own.
    """

    def __init__(self, engine: AIOEngine, outbox: Outbox) -> None:
        self.engine = engine
        self.outbox = outbox

    async def save(
        self,
        instance: Model,
        events: Sequence[Event],
        *,
        session: Any = None,
        expected_version: int | None = None,
    ) -> Saved:
        """Insert or update ``instance`` with ``events``, as ``AIOEngine.save`` writes it.
        ``session``: an ODMantic ``AIOSession``/``AIOTransaction`` or a Motor session."""
        fields = instance.__fields_modified__ | instance.__mutable_fields__
        owned = self.outbox.owned_fields
        primary = instance.__primary_field__
        body = instance.model_dump_doc(include=fields) if fields else {}
        key = instance.model_dump_doc(include={primary})
        changed = {k: v for k, v in body.items() if k != "_id" and k not in owned}
        driver = _driver_session(session)
        saved = await self.outbox.update_with_events(
            driver,
            self.engine.get_collection(type(instance)),
            key,
            {"$set": changed},
            events,
            # Only a new instance (all its fields modified, its primary key with them) is
            # created: one loaded and deleted meanwhile is not re-created from the fields it
            # sends, its sequence starting again at 1.
            upsert=primary in instance.__fields_modified__,
            expected_version=expected_version,
        )
        if not getattr(driver, "in_transaction", False):
            # In the caller's transaction the write may yet be aborted: until it commits, the
            # instance keeps what it would send and its version, so a save after an abort
            # creates it again, and is guarded as the first try was.
            _set_version(instance, saved)
            object.__setattr__(instance, "__fields_modified__", set())
        return saved

    async def delete(
        self,
        instance: Model,
        events: Sequence[Event],
        *,
        session: Any = None,
        expected_version: int | None = None,
    ) -> Saved:
        """Delete ``instance`` with ``events`` (collection mode), as ``AIOEngine.delete``."""
        return await self.outbox.delete_with_events(
            _driver_session(session),
            self.engine.get_collection(type(instance)),
            instance.model_dump_doc(include={instance.__primary_field__}),
            events,
            expected_version=expected_version,
        )


def _set_version(instance: Model, saved: Saved) -> None:
    """The outbox's version in the field stored as ``_version``, if the model has one, left
    unmodified: a modified field is one ODMantic's own save would send back."""
    for name, field in type(instance).__odm_fields__.items():
        if field.key_name == "_version":
            modified = name in instance.__fields_modified__
            setattr(instance, name, saved.version)
            if not modified:
                instance.__fields_modified__.discard(name)


def _driver_session(session: Any) -> Any:
    """ODMantic's session objects hold the Motor session the outbox joins."""
    driver = getattr(session, "get_driver_session", None)
    return driver() if driver is not None else session
