"""The write side: ``Outbox`` and the outbox's storage layout.

Collection mode stores each event as a document of the outbox collection, written in the same
multi-document transaction as the aggregate. Embedded mode appends the events to an array field of
the aggregate document itself, so the aggregate and its events are one single-document write,
after the event ids were reserved in the registry (``_write/event_ids.py`` says why that second
write loses nothing).

The aggregate keeps two counters, ``_version`` (one step per write) and ``_sequence`` (one step
per event, so events carry a gap-free per-aggregate sequence), written by ``_write/documents.py``.

Everything that can be checked before writing is (``_write/rules.py``), so bad input writes nothing;
what only the server can find (an update that does not apply to the stored document, a document
grown too large with its pending entries) fails the one write that would have stored it, inside
the aborted transaction in collection mode. ``mongo_outbox.sync.Outbox`` runs the same rules and
the same writes (``_write/engine.py``) with PyMongo's sync API.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pymongo.errors import PyMongoError

from mongo_outbox._driver import start_session
from mongo_outbox._steps import run_async
from mongo_outbox._write.engine import WriteEngine
from mongo_outbox._write.layout import Mode
from mongo_outbox._write.plan import Plan, Written
from mongo_outbox._write.sessions import abandons, check_free, lent
from mongo_outbox.events import Event

__all__ = ["Mode", "Outbox", "Saved"]


@dataclass(frozen=True)
class Saved:
    """What a write with events did: the aggregate's ``_id``, its new version and the events
    as stored (with ``aggregate_type``, ``aggregate_id`` and ``sequence`` filled in)."""

    id: Any
    version: int
    events: list[Event]


class Outbox(WriteEngine):
    """Writes aggregates with their events, and knows where the relay finds them.

    Parameters:
        db: a PyMongo ``AsyncDatabase`` or a Motor database. Aggregates are saved in its
            collections only: the relay reads this client and database.
        mode: ``"collection"`` (events in the outbox collection, one transaction per write) or
            ``"embedded"`` (events inside the aggregate document, no transaction needed).
        collection: the outbox collection's name (collection mode); embedded mode keeps its
            event-id registry in ``<collection>_event_ids``.
        collections: the aggregate collections the relay scans (embedded mode, required there).
        retention: how long published entries (and embedded event-id reservations) are kept
            before the TTL index prunes them.
        field: the array field that holds embedded events: a top-level field name (no dots).
        aggregate_types: the ``aggregate_type`` of each collection's events, where it is not the
            collection's name, e.g. ``{"orders": "Order"}``. One type per collection, and never
            another collection's name.
        partitions: how many partitions a ``RelayGroup`` shares (default 1: none). Each write
            stores its aggregate's partition with its entries; the count is recorded in
            ``<collection>_config`` and a writer with another count raises
            ``ConfigurationError`` (docs/groups.md says how to change it).

    Every write takes a ``session``, which may be ``None``; in collection mode a session and
    transaction are then started here. A session inside an open transaction is joined and not
    committed.
    """

    _ASYNC = True

    async def ensure_indexes(self) -> None:
        """Create the indexes the relay and the TTL pruning need. Idempotent."""
        await run_async(self._index_steps())

    async def save_with_events(
        self,
        session: Any,
        collection: Any,
        document: dict[str, Any],
        events: Sequence[Event],
        *,
        expected_version: int | None = None,
    ) -> Saved:
        """Insert or replace ``document`` (by ``_id``) and record ``events``, atomically.

        ``expected_version=0`` means "must not exist yet" (a document written without the
        outbox exists too) and inserts; ``N`` means "stored version is N". Fields the outbox owns
        (``_version``, ``_sequence`` and the embedded fields) are taken from the stored document,
        never from ``document``.
        """
        plan = self._rules.save(session, collection, document, events, expected_version)
        return await self._run(plan, session)

    async def update_with_events(
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
        """Apply ``update`` (update operators, or a pipeline of ``$set``/``$unset`` stages) to
        the aggregate ``filter`` selects and record ``events``, atomically.

        ``filter`` names the aggregate by ``_id``; other conditions may join it and must hold
        too. No match raises ``AggregateNotFoundError`` (unless ``upsert``), a stored version
        other than ``expected_version`` raises ``ConcurrencyError`` (``0``: must not exist yet,
        with ``upsert=True``). An update that writes a field the outbox owns is refused.
        ``array_filters`` are the filters of the ``$[identifier]`` positions an update of
        operators uses (``{"$set": {"items.$[i].qty": 2}}`` with ``[{"i.sku": "a"}]``), as
        PyMongo's ``update_one`` takes them.
        """
        plan = self._rules.update(
            session, collection, filter, update, events, upsert, expected_version, array_filters
        )
        return await self._run(plan, session)

    async def delete_with_events(
        self,
        session: Any,
        collection: Any,
        filter: dict[str, Any],
        events: Sequence[Event],
        *,
        expected_version: int | None = None,
    ) -> Saved:
        """Delete the aggregate ``filter`` selects (by ``_id``) and record ``events``,
        atomically. Collection mode only: embedded mode raises ``UsageError`` (its events live
        in the document). ``Saved.version`` is the deleted document's version plus one."""
        plan = self._rules.delete(session, collection, filter, events, expected_version)
        return await self._run(plan, session)

    async def add_events(
        self, session: Any, collection: Any, aggregate_id: Any, events: Sequence[Event]
    ) -> Saved:
        """Record ``events`` of the aggregate whose ``_id`` is ``aggregate_id``, beside writes
        you made yourself in the transaction ``session`` has open (required). Collection mode.
        The aggregate document must exist: its counters number the events."""
        plan = self._rules.add(session, collection, aggregate_id, events)
        return await self._run(plan, session)

    async def _run(self, plan: Plan, session: Any) -> Saved:
        if not self._transactional(session):
            joined = session is not None and session.in_transaction
            if joined:
                check_free(session)
            try:
                return Saved(*await run_async(self._steps(plan, session)))
            except BaseException as error:
                # (A coroutine closed unawaited, GeneratorExit, cannot await the abort.)
                if joined and abandons(plan.kind, error):
                    await _abandon(session)
                raise

        async def write(own: Any) -> Written:
            return await run_async(self._steps(plan, own))

        if session is not None:
            with lent(session):
                return Saved(*await _with_transaction(session, write))
        async with await start_session(self.db.client) as own:
            return Saved(*await _with_transaction(own, write))


async def _abandon(session: Any) -> None:
    """Abort the caller's transaction a failed write had joined (``sessions.abandons``): a
    commit would store a change without its events."""
    with contextlib.suppress(PyMongoError):
        await asyncio.shield(session.abort_transaction())


async def _with_transaction(session: Any, write: Callable[[Any], Awaitable[Written]]) -> Written:
    # with_transaction retries TransientTransactionError and UnknownTransactionCommitResult
    # as the driver spec prescribes, for up to 120 s.
    result: Written = await session.with_transaction(write)
    return result
