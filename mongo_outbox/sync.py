"""The write side for PyMongo's sync client (``pymongo.MongoClient``): Flask, Django, scripts.

``from mongo_outbox.sync import Outbox`` writes exactly what ``mongo_outbox.Outbox`` writes: the
same rules, the same steps (``_write/engine.py``), the same documents and entries. So the async
relays (``PollingRelay``, ``ChangeStreamRelay``, in a service of their own) publish what it saved,
unchanged; build theirs with ``mongo_outbox.Outbox`` over an ``AsyncMongoClient`` of the same
database. The relays and the inbox stay async.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from pymongo.errors import PyMongoError

from mongo_outbox._steps import run_sync
from mongo_outbox._write.engine import WriteEngine
from mongo_outbox._write.plan import Plan, Written
from mongo_outbox._write.sessions import abandons, check_free, lent
from mongo_outbox.events import Event
from mongo_outbox.outbox import Saved

__all__ = ["Outbox", "Saved"]


class Outbox(WriteEngine):
    """``mongo_outbox.Outbox`` for a ``pymongo.database.Database``: the same parameters, the
    same methods without ``await``, the same storage layout.

    Parameters:
        db: a ``pymongo.database.Database`` (of a ``MongoClient``). Aggregates are saved in its
            collections only.
        mode, collection, collections, retention, field, aggregate_types: as for
            ``mongo_outbox.Outbox``; give the relay's outbox the same values.
    """

    _ASYNC = False

    def ensure_indexes(self) -> None:
        """Create the indexes the relay and the TTL pruning need. Idempotent."""
        run_sync(self._index_steps())

    def save_with_events(
        self,
        session: Any,
        collection: Any,
        document: dict[str, Any],
        events: Sequence[Event],
        *,
        expected_version: int | None = None,
    ) -> Saved:
        """Insert or replace ``document`` (by ``_id``) and record ``events``, atomically.
        See ``mongo_outbox.Outbox.save_with_events``."""
        plan = self._rules.save(session, collection, document, events, expected_version)
        return self._run(plan, session)

    def update_with_events(
        self,
        session: Any,
        collection: Any,
        filter: dict[str, Any],
        update: dict[str, Any] | list[dict[str, Any]],
        events: Sequence[Event],
        *,
        upsert: bool = False,
        expected_version: int | None = None,
        array_filters: Sequence[Mapping[str, Any]] | None = None,
    ) -> Saved:
        """Apply ``update`` to the aggregate ``filter`` selects (by ``_id``) and record
        ``events``, atomically. See ``mongo_outbox.Outbox.update_with_events``."""
        plan = self._rules.update(
            session, collection, filter, update, events, upsert, expected_version, array_filters
        )
        return self._run(plan, session)

    def delete_with_events(
        self,
        session: Any,
        collection: Any,
        filter: dict[str, Any],
        events: Sequence[Event],
        *,
        expected_version: int | None = None,
    ) -> Saved:
        """Delete the aggregate ``filter`` selects and record ``events``, atomically (collection
        mode). See ``mongo_outbox.Outbox.delete_with_events``."""
        plan = self._rules.delete(session, collection, filter, events, expected_version)
        return self._run(plan, session)

    def add_events(
        self, session: Any, collection: Any, aggregate_id: Any, events: Sequence[Event]
    ) -> Saved:
        """Record ``events`` beside writes you made in the transaction ``session`` has open
        (collection mode). See ``mongo_outbox.Outbox.add_events``."""
        plan = self._rules.add(session, collection, aggregate_id, events)
        return self._run(plan, session)

    def _run(self, plan: Plan, session: Any) -> Saved:
        if not self._transactional(session):
            joined = session is not None and session.in_transaction
            if joined:
                check_free(session)
            try:
                return Saved(*run_sync(self._steps(plan, session)))
            except BaseException as error:
                if joined and abandons(plan.kind, error):  # as mongo_outbox.Outbox does
                    with contextlib.suppress(PyMongoError):
                        session.abort_transaction()
                raise

        def write(own: Any) -> Written:
            return run_sync(self._steps(plan, own))

        # with_transaction retries TransientTransactionError and UnknownTransactionCommitResult
        # as the driver spec prescribes, for up to 120 s.
        if session is not None:
            with lent(session):
                return Saved(*session.with_transaction(write))
        with self.db.client.start_session() as own:
            return Saved(*own.with_transaction(write))
