"""TenantRelays: one process relays the outboxes of several databases (tenants).

Each database keeps a relay of its own (its own change stream or polling rounds, its own lease
and checkpoint, in its own database), and each runs as its own task. What they share is the
process, the event loop, MongoDB and, if the caller passes the same one to each, a publisher
and its connection. Side by side, a database with a backlog ran round after round and the
others' events waited behind its claims, waves and settles (a trickling tenant's p50 went from
0.6 s to 10-21 s while another drained 5,000 events), so their rounds' claims and settles
take turns (``_relay/turns.py``): one at a time, the next turn to the next database in rotation that
has one waiting, with smaller rounds while several databases are active.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

from mongo_outbox._relay.turns import Turns
from mongo_outbox.errors import UsageError
from mongo_outbox.relay import Relay
from mongo_outbox.status import GroupStatus, RelayStatus, State

__all__ = ["TenantRelays", "current_database", "for_database"]

log = logging.getLogger(__name__)

_database: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mongo_outbox_tenant", default=None
)


def current_database() -> str | None:
    """The database whose relay the calling code runs for under ``TenantRelays`` (in its task,
    or in one that task started); ``None`` elsewhere. For a log filter: every tenant's relay
    usually has the same name, so its own lines do not say which database they are about."""
    return _database.get()


@contextlib.contextmanager
def for_database(database: str) -> Iterator[None]:
    """Inside, ``current_database()`` is ``database``, also in the tasks started inside."""
    token = _database.set(database)
    try:
        yield
    finally:
        _database.reset(token)


async def _run_for(database: str, relay: Relay) -> None:
    with for_database(database):
        await relay.run()


_owners: dict[int, weakref.ref[TenantRelays]] = {}
"""The ``TenantRelays`` each relay belongs to, by the relay's ``id``: from its build until its
``run()`` ends, then again while a later ``run()`` runs. An owner holds its relays, so no other
object takes that ``id`` while it is listed; its entries go with it."""


def _release(relays: list[int], owner: weakref.ref[TenantRelays]) -> None:
    for key in relays:
        if _owners.get(key) is owner:
            del _owners[key]


@runtime_checkable
class _TakesTurns(Protocol):
    """A relay whose rounds can take turns with the other tenants' (the library's relays)."""

    turns: Turns | None


class TenantRelays:
    """Runs one relay per database in one process, side by side.

    Parameters:
        relays: a ``Relay`` per outbox (``PollingRelay``, ``ChangeStreamRelay``, a
            ``RelayGroup`` member, or one of your own), each over the ``Outbox`` of its own
            database. They may share a publisher. The library's relays take turns (see above);
            one of your own runs beside them as it is.

    ``run()`` runs them all until ``stop()``. If one fails, the others are stopped (giving their
    leases up) and ``run()`` raises that failure: a process is healthy or it exits, so a
    supervisor restarting it restarts every tenant's relay with it.
    """

    def __init__(self, relays: Sequence[Relay]) -> None:
        self.relays: dict[str, Relay] = {}
        for relay in relays:
            if not isinstance(relay, Relay):
                raise UsageError(
                    "TenantRelays takes relays (objects with name, outbox, state, last_error, "
                    f"run(), stop() and status(): see mongo_outbox.relay.Relay), "
                    f"not {type(relay).__name__}"
                )
            database = relay.outbox.db.name
            if database in self.relays:
                # Two relays of one outbox in one process compete with themselves for a lease
                # (or for claims): that is a mistake, not a way to go faster.
                raise UsageError(
                    f"TenantRelays got two relays for database {database!r}: "
                    "give each database one relay"
                )
            self.relays[database] = relay
        if not self.relays:
            raise UsageError("TenantRelays needs at least one relay")
        self.turns = Turns()
        """The rounds' turns, shared by every relay here (``history``: who had the latest)."""
        self._me = weakref.ref(self)
        self._take()
        weakref.finalize(self, _release, list(map(id, self.relays.values())), self._me)
        self._stopping = False
        self._running = False

    def _take(self) -> None:
        """Make every relay this one's, or raise ``UsageError`` taking none: at the build, and
        at each ``run()`` (the relays are free again once a ``run()`` ends)."""
        for relay in self.relays.values():
            if self._of_another(relay):
                # Running here too would stop it there (or be refused) and leave its database
                # unrelayed under a healthy state. The library's relays and your own alike.
                raise UsageError(
                    f"the relay {relay.name!r} of database {relay.outbox.db.name!r} belongs "
                    "to another TenantRelays: give each TenantRelays relays of its own, or "
                    "build the next once the other's run() has ended"
                )
        for relay in self.relays.values():
            _owners[id(relay)] = self._me
            if isinstance(relay, _TakesTurns):
                relay.turns = self.turns
                self.turns.join(relay.outbox.db.name)

    def _of_another(self, relay: Relay) -> bool:
        owner = _owners.get(id(relay))
        return owner is not None and owner is not self._me and owner() is not None

    async def run(self) -> None:
        """Run every relay until ``stop()`` or cancellation; see the class for failures."""
        if self._running:
            raise UsageError(
                "TenantRelays.run(): already running; one TenantRelays runs one loop at a time"
            )
        self._take()  # another may have had them since this one's last run() ended
        self._running = True
        try:
            await self._run()
        finally:
            self._running = False
            # Ended: a supervisor may build a new TenantRelays of the same relays (this one
            # lives on meanwhile: a name still bound to it, the traceback of its failure).
            _release(list(map(id, self.relays.values())), self._me)

    async def _run(self) -> None:
        self._stopping = False
        tasks = {
            asyncio.ensure_future(_run_for(database, relay)): database
            for database, relay in self.relays.items()
        }
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failed = [t for t in done if not t.cancelled() and t.exception() is not None]
                if failed:
                    log.warning(
                        "tenant relays: the relay of database %s failed: stopping the others",
                        tasks[failed[0]],
                    )
                    # Only those still running: a stop() left on one that ended would make its
                    # next run() return at once.
                    self._stopping = True
                    for task in pending:
                        self.relays[tasks[task]].stop()
                    if pending:  # none when the last one running failed
                        await asyncio.wait(pending)
                    raise failed[0].exception()  # type: ignore[misc]
                if not self._stopping:
                    # A relay returns only when stopped: someone stopped it directly.
                    for task in done:
                        log.info("tenant relays: the relay of database %s stopped", tasks[task])
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def state(self) -> State:
        """One state for the whole process, as ``/healthz`` reads it: ``failed`` if any relay
        failed, ``stopped`` once all stopped, ``starting`` while any is, then ``active`` if any
        publishes, else ``standby``."""
        states = {relay.state for relay in self.relays.values()}
        for state in ("failed", "stopped", "starting", "active"):
            if state in states and (state != "stopped" or states == {"stopped"}):
                return state
        return "standby"

    def stop(self) -> None:
        """Stop every relay once its publishes in flight are confirmed (each gives its lease up)."""
        self._stopping = True
        for relay in self.relays.values():
            if not self._of_another(relay):  # given to another since this one ended: its own
                relay.stop()

    async def status(self) -> Mapping[str, RelayStatus | GroupStatus]:
        """Each relay's ``status()``, by database name."""
        statuses: list[RelayStatus | GroupStatus] = list(
            await asyncio.gather(*(relay.status() for relay in self.relays.values()))
        )
        return dict(zip(self.relays, statuses, strict=True))
