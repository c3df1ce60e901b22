"""RelayGroup: any number of processes share an outbox's partitions, each publishing its own.

An outbox with ``partitions=P`` stores each entry's partition (``_partitions``). Every member of
a group beats a heartbeat in the members collection (``_relay.group``), counts the live members
``N`` and wants its fair share, ``P // N`` or one more, by rank; for each partition it wants it
runs a worker that stands by until it holds that partition's lease, then publishes it: polling
rounds filtered on the partition, or a change stream ``$match``-ed on it with its own checkpoint.

A partition lease is a ``_relay.lease.FencedLease`` named ``<group>/<partition>``:
taking it over sets a new fence, every renewal (and every checkpoint write) is conditional on
the fence, and the holder stops publishing (before its next wave) once a renewal fails or eight
tenths of the lease passed without one, before another member can take the lease. So a
partition is published by one member at a time, and per-aggregate order holds across
rebalances: the new holder starts from the outbox's pending entries (and, with change streams,
from the partition's checkpoint); entries a dead holder claimed come back after their claim
lease, in order, as with any relay.

A member that stops gives its partitions back at once; one that dies lets its heartbeat and
leases run out, and the others take its partitions over within about ``member_lease`` and a
second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from typing import Literal

from pymongo.errors import PyMongoError

from mongo_outbox._partitions import check_config
from mongo_outbox._relay.group.members import Membership, share
from mongo_outbox._relay.group.workers import PollingWorker, StreamWorker, Worker
from mongo_outbox._relay.lease import FencedLease
from mongo_outbox._relay.lifecycle import Lifecycle
from mongo_outbox._relay.rounds import Rounds, pause
from mongo_outbox._relay.store import store_for
from mongo_outbox._relay.turns import Turns
from mongo_outbox._steps import run_async
from mongo_outbox._storage import LEASE_UNTIL, OWNER
from mongo_outbox.brokers._publishing import Publisher
from mongo_outbox.changestream.relay import ChangeStreamRelay
from mongo_outbox.errors import ConfigurationError, describe
from mongo_outbox.events import utc_now
from mongo_outbox.outbox import Outbox
from mongo_outbox.settings import (
    Duration,
    RelaySettings,
    check_name,
    check_relay_settings,
    check_seconds,
    check_timedelta,
)
from mongo_outbox.status import GroupStatus

__all__ = ["GroupStatus", "RelayGroup"]

log = logging.getLogger(__name__)

Source = Literal["polling", "changestream"]

REBALANCE_EVERY = 1.0
"""Longest time in seconds between two heartbeats (and looks at the membership) of a member."""

ASSIGN_CHUNK = 1000
"""How many entries without a partition one query gives theirs."""


class RelayGroup(Lifecycle):
    """One member of a relay group: publishes its fair share of an outbox's partitions.

    Run one in each process (any number, started and stopped at will); they share the outbox's
    ``partitions`` among themselves and rebalance as members come and go.

    Parameters:
        outbox: the Outbox to relay, with ``partitions`` set (the same in every writer).
        publisher: any Publisher; the member's partitions publish through it side by side.
        name: the group's name: its leases and heartbeats.
        source: ``"polling"`` (rounds of claims per partition) or ``"changestream"`` (a change
            stream per partition, with its own checkpoint).
        settings: entries per round, in-flight window, timeouts, claim lease, attempts, backoff.
        member_lease: how long a member's heartbeat and partition leases last without renewal
            (they are renewed every third of it); a dead member's partitions are taken over
            within about this and a second. At least 2.5 times ``settings.publish_timeout``: a
            member stops starting publishes ``publish_timeout`` before eight tenths of the
            lease since its last renewal, so the last ones end before the lease can.
        interval: polling: how long a partition's worker sleeps when nothing is pending.
        checkpoints: the collection of the partition leases (and change-stream checkpoints).
        members: the collection of the members' heartbeats.
    """

    def __init__(
        self,
        outbox: Outbox,
        publisher: Publisher,
        *,
        name: str = "relay-group",
        source: Source = "polling",
        settings: RelaySettings | None = None,
        member_lease: Duration = 30.0,
        interval: Duration = 1.0,
        checkpoints: str = "outbox_relays",
        members: str = "outbox_relay_members",
    ) -> None:
        if source not in ("polling", "changestream"):
            raise ConfigurationError(
                f"RelayGroup.source must be 'polling' or 'changestream', not {source!r}",
                setting="RelayGroup.source",
            )
        super().__init__(check_name(name, "RelayGroup.name"), log)
        self.source: Source = source
        self.outbox = outbox
        self.publisher = publisher
        self.settings = check_relay_settings(settings, "RelayGroup.settings")
        outbox.check_relay_collection(checkpoints, "RelayGroup.checkpoints")
        outbox.check_relay_collection(members, "RelayGroup.members")
        self.member_lease = check_timedelta(member_lease, "RelayGroup.member_lease")
        timeout = self.settings.publish_timeout
        if self.member_lease.total_seconds() < 2.5 * timeout:
            # A member stops starting publishes publish_timeout before 0.8 of its lease, so the
            # ones it started end before another member can take the partition: that leaves
            # time for renewals only with a lease of at least 2.5 times publish_timeout.
            raise ConfigurationError(
                f"RelayGroup.member_lease ({self.member_lease.total_seconds():g} s) must be at "
                f"least 2.5 times RelaySettings.publish_timeout ({timeout:g} s)",
                setting="RelayGroup.member_lease",
            )
        self.interval = check_seconds(interval, "RelayGroup.interval")
        self.member = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._leases = outbox.db[checkpoints]
        self._checkpoints = checkpoints
        self._membership = Membership(outbox.db[members], self.name, self.member, self.member_lease)
        self._store = store_for(outbox)
        self.turns: Turns | None = None
        """Shared with other tenants' relays (``TenantRelays``): each round waits its turn."""
        self._workers: dict[int, Worker] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}

    @property
    def partitions(self) -> int:
        return self.outbox.partitions

    @property
    def owned(self) -> list[int]:
        """The partitions this member publishes now (it holds their leases)."""
        return sorted(k for k, w in self._workers.items() if w.fence is not None)

    def fence(self, partition: int) -> int | None:
        """This member's fence of ``partition``'s lease while it holds it, else None."""
        worker = self._workers.get(partition)
        return worker.fence if worker is not None else None

    async def run(self) -> None:
        """Beat, rebalance and publish until ``stop()`` or cancellation. Database errors are
        logged and retried with backoff; a partition count other than the recorded one raises
        ``ConfigurationError`` before anything is published; a partition's worker that raises
        (``ChangeStreamError``) makes it raise that, once every partition was given back."""
        with self._running():
            await run_async(check_config(self.outbox.config, self.partitions, "this RelayGroup"))
            # Entries saved before the outbox had partitions (or by a writer that read the
            # record before it existed) have none, so no partition's worker would ever claim them.
            while await self._assign_partitions() == ASSIGN_CHUNK:
                pass
            self._enter("active", f"member {self.member}")
            await self._beat()

    async def _beat(self) -> None:
        """Beat and rebalance until ``stop()``, then give the partitions back and leave."""
        # At least once a second, whatever the lease: a newcomer is counted, and given its
        # share, within a second or so (the heartbeat still lives ``member_lease``).
        beat = min(self.member_lease.total_seconds() / 3, REBALANCE_EVERY)
        failures = 0
        failed: BaseException | None = None
        try:
            while not self._stopping.is_set():
                try:
                    failed = self._failed_worker()
                    if failed is not None:
                        break
                    await self._rebalance()
                    failures = 0
                except PyMongoError as error:
                    failures += 1
                    self.last_error = describe(error)
                    log.warning("group %s: heartbeat failed: %s", self.name, self.last_error)
                await pause(self._stopping, beat if not failures else min(beat, 0.5 * failures))
        except asyncio.CancelledError:
            # Cancellation stands for a crash: the workers end now, leases and heartbeat run out.
            for task in self._tasks.values():
                task.cancel()
            if self._tasks:
                await asyncio.wait(set(self._tasks.values()))
            self._forget()
            raise
        for worker in self._workers.values():
            worker.stop()
        if self._tasks:
            await asyncio.wait(set(self._tasks.values()))  # each gives its lease back
        if failed is None:
            self._failed_worker()  # one that failed as the member stopped: logged, at least
        self._forget()
        with contextlib.suppress(PyMongoError):
            await self._membership.leave()
        if failed is not None:
            raise failed

    def _failed_worker(self) -> BaseException | None:
        """The error a partition's worker raised, if one did: what it retries (MongoDB out of
        reach) it does not raise, so this one would come back every beat (a change stream
        MongoDB refuses, a publisher that is not one): the member fails, as a relay does,
        after giving every partition back, rather than retry it every second while healthy."""
        for k, task in self._tasks.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                error: BaseException = task.exception()  # type: ignore[assignment]
                log.error("group %s: partition %d failed: %s", self.name, k, describe(error))
                return error
        return None

    def _forget(self) -> None:
        self._workers.clear()
        self._tasks.clear()

    async def _rebalance(self) -> None:
        # Workers that ended (a lease given back) leave the books first.
        for k, task in list(self._tasks.items()):
            if task.done():
                del self._tasks[k]
                self._workers.pop(k, None)
        # A writer that checked the partition record before it existed writes entries without
        # a partition until it restarts: one chunk of them each beat.
        await self._assign_partitions()
        live = await self._membership.beat(self.owned)
        wanted = set(share(live, self.member, self.partitions))
        for k, worker in self._workers.items():
            if k not in wanted and not worker.stopping:
                log.info("group %s: giving partition %d back (%d members)", self.name, k, len(live))
                worker.stop()
        for k in sorted(wanted - set(self._workers)):
            worker = self._worker(k)
            self._workers[k] = worker
            self._tasks[k] = asyncio.ensure_future(worker.run())

    async def _assign_partitions(self) -> int:
        assigned = await self._store.assign_partitions(ASSIGN_CHUNK)
        if assigned:
            log.warning(
                "group %s: %d pending entries had no partition (saved before the outbox had "
                "partitions=%d, or by a writer without it): gave them their aggregate's; every "
                "writer must use Outbox(..., partitions=%d)",
                self.name,
                assigned,
                self.partitions,
                self.partitions,
            )
        return assigned

    def _worker(self, k: int) -> Worker:
        name = f"{self.name}/{k}"
        if self.source == "changestream":
            relay = ChangeStreamRelay(
                self.outbox,
                self.publisher,
                name=name,
                partition=k,
                settings=self.settings,
                leader_lease=self.member_lease,
                checkpoints=self._checkpoints,
            )
            relay.checkpoint.owner = self.member
            relay.turns = self.turns
            return StreamWorker(relay)
        lease = FencedLease(self._leases, name, self.member_lease)
        lease.owner = self.member
        rounds = Rounds(self.outbox, self.publisher, self.settings, k, relay=name)
        rounds.command_wait = max(rounds.command_wait, self.member_lease.total_seconds())
        rounds.turns = self.turns
        return PollingWorker(self.name, k, lease, rounds, self.interval, self.outbox.db.name)

    async def status(self) -> GroupStatus:
        """Who owns which partition (from the leases), the live members and what each holds,
        this member's partitions, and the outbox's pending entries."""
        names = [f"{self.name}/{k}" for k in range(self.partitions)]
        now = utc_now()
        owners: dict[int, str | None] = dict.fromkeys(range(self.partitions))
        async for doc in self._leases.find({"_id": {"$in": names}}):
            until = doc.get(LEASE_UNTIL)
            if until is not None and until.replace(tzinfo=now.tzinfo) > now:
                owners[int(str(doc["_id"]).rsplit("/", 1)[1])] = doc.get(OWNER)
        live = await self._membership.live()
        backlog = await Rounds(self.outbox, self.publisher, self.settings).store.backlog()
        return GroupStatus(
            name=self.name,
            member=self.member,
            state=self.state,
            partitions=self.partitions,
            owned=tuple(self.owned),
            owners=owners,
            members={d["_id"]: tuple(d.get("partitions") or ()) for d in live},
            pending=backlog.pending,
            published=sum(w.published for w in self._workers.values()),
            last_error=self.last_error,
        )
