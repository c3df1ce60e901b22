"""PollingRelay: claims pending outbox entries with a lease, publishes, marks them published."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pymongo.errors import PyMongoError

from mongo_outbox import metrics
from mongo_outbox._relay.lifecycle import Lifecycle
from mongo_outbox._relay.rounds import PROBE_EVERY, Rounds, pause
from mongo_outbox.admin import OutboxAdmin
from mongo_outbox.brokers._publishing import Publisher
from mongo_outbox.errors import describe
from mongo_outbox.outbox import Outbox
from mongo_outbox.settings import (
    Duration,
    RelaySettings,
    check_name,
    check_relay_settings,
    check_seconds,
)
from mongo_outbox.status import GroupStatus, RelayCounters, RelayStats, RelayStatus, State

if TYPE_CHECKING:
    from mongo_outbox._relay.turns import Turns

__all__ = ["PollingRelay", "Relay", "RelayCounters", "RelayStats"]

log = logging.getLogger(__name__)


@runtime_checkable
class Relay(Protocol):
    """What every relay offers: ``PollingRelay``, ``ChangeStreamRelay``, a ``RelayGroup`` member,
    or one of your own; ``TenantRelays`` runs any of them.

    ``run()`` relays until ``stop()`` (also one called before it started) or cancellation, and
    raises what it cannot retry. ``state`` is ``starting`` until then, ``standby`` or ``active``
    while it runs, ``stopped`` or ``failed`` after; ``last_error`` is the latest error it met,
    as ``describe()`` writes it. ``outbox`` is the outbox it publishes.
    """

    @property
    def name(self) -> str: ...

    @property
    def outbox(self) -> Outbox: ...

    @property
    def state(self) -> State: ...

    @property
    def last_error(self) -> str | None: ...

    async def run(self) -> None: ...

    def stop(self) -> None: ...

    async def status(self) -> RelayStatus | GroupStatus: ...


class PollingRelay(Lifecycle):
    """Publishes an outbox's pending events, in sequence order per aggregate.

    Several relays may run side by side, in one process or many: each claims a round's entries
    with a lease, and an entry is published only after every earlier entry of its aggregate
    has been, so a crashed relay's claims come back after the lease and keep their place in
    line. One relay object runs one loop at a time: a second ``run()`` or ``drain()`` while one
    runs raises ``UsageError`` (create another relay object to publish side by side).

    Parameters:
        outbox: the Outbox to relay.
        publisher: any object with ``async publish(event)`` and ``async aclose()``.
        settings: entries per round, in-flight window, timeouts, claim lease, attempts, backoff.
        interval: how long to sleep when nothing is pending (seconds or a timedelta).
        name: what ``status()`` and the log call this relay.
    """

    def __init__(
        self,
        outbox: Outbox,
        publisher: Publisher,
        *,
        settings: RelaySettings | None = None,
        interval: Duration = 1.0,
        name: str = "polling-relay",
    ) -> None:
        name = check_name(name, "PollingRelay.name")
        self._gauges = metrics.RelayGauges(name, outbox.db.name)
        super().__init__(name, log, self._gauges)
        self.settings = check_relay_settings(settings, "PollingRelay.settings")
        self.interval = check_seconds(interval, "PollingRelay.interval")
        self.outbox = outbox
        self.publisher = publisher
        self._rounds = Rounds(outbox, publisher, self.settings, relay=self.name)

    @property
    def stats(self) -> RelayCounters:
        return self._rounds.stats

    @property
    def turns(self) -> Turns | None:
        """Shared with other tenants' relays (``TenantRelays``): each round waits its turn."""
        return self._rounds.turns

    @turns.setter
    def turns(self, turns: Turns | None) -> None:
        self._rounds.turns = turns

    async def drain(self) -> int:
        """Publish everything due now; return how many events were published. Entries that
        fail are left for a later retry, not waited for; entries due later (saved meanwhile,
        say) are left to ``run()``."""
        with self._exclusive("drain()"):
            return await self._rounds.drain()

    async def run(self) -> None:
        """Relay until ``stop()`` (also one called before ``run()`` started) or cancellation.
        Database errors are logged and retried with backoff."""
        with self._running():
            # Active once its gauges were read: a probe that sees it active can scrape them.
            async with self._gauges.refreshing(self.status):
                self._enter("active", "run() started")
                await self._relay()

    async def _relay(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                # A stop ends the round before its next wave, not after all of them: with a
                # slow broker, a round of many waves took longer than a service's stop timeout.
                _, more = await self._rounds.one(lost=self._stopping)
                failures = 0
            except PyMongoError as error:
                failures += 1
                delay = self.settings.backoff.delay(failures)
                self.last_error = describe(error)
                log.warning("relay round failed (%s); retrying in %.1fs", error, delay)
                await pause(self._stopping, delay)
                continue
            if not more:
                # During an outage, come back for the next probe, however long the interval.
                idle = min(self.interval, PROBE_EVERY) if self._rounds.outage else self.interval
                await pause(self._stopping, idle)

    async def status(self) -> RelayStatus:
        """What an operator needs to see, as ``ChangeStreamRelay.status()`` reports it: ``state``
        is ``starting`` until ``run()``, ``active`` while it runs, then ``stopped`` (or
        ``failed`` when it raised). Polling relays hold no lease and keep no checkpoint, so
        several are active at once and ``last_checkpoint_at`` is ``None``; ``recoveries`` stays
        0 (a failed round is retried, and its error kept in ``last_error``)."""
        return await self._rounds.status(
            self.name,
            lambda: (self.state, self.state == "active"),
            last_error=lambda: self.last_error,
        )

    async def publish_round(self, until: datetime | None = None) -> tuple[int, bool]:
        """One round: claim (what is due by ``until``, default now), publish, settle. Returns
        (published, more may be waiting)."""
        with self._exclusive("publish_round()"):
            return await self._rounds.one(until)

    # The name of before: "batch" now means nothing in a relay (docs/architecture.md, Words).
    publish_batch = publish_round

    async def parked(self) -> list[dict[str, Any]]:
        """Parked entries: ``_id`` (the event id), the event's fields,
        ``status: "parked"``, ``attempts`` and ``last_error``; in embedded mode also
        ``collection``, as they stay in their aggregate's document."""
        # As every operator's tool reads them: through the outbox's admin, read whole.
        page = await OutboxAdmin(self.outbox).parked(whole=True)
        return [dict(entry.document) for entry in page.entries]

    async def requeue(self, event_ids: Sequence[str]) -> int:
        """Make parked entries due again, with a fresh set of attempts, together with the
        earlier parked entries of their aggregates, so none overtakes another. Returns how
        many were requeued (ids that are not parked are ignored)."""
        return await OutboxAdmin(self.outbox).requeue(event_ids)
