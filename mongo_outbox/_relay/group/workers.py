"""What a relay group member runs for each partition it wants: a worker that stands by until it
holds the partition's lease, then publishes that partition, until stopped (see ``group``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from pymongo.errors import PyMongoError

from mongo_outbox import metrics
from mongo_outbox._relay.lease import FencedLease
from mongo_outbox._relay.rounds import AnyOf, Rounds, pause
from mongo_outbox.errors import describe
from mongo_outbox.status import RelayCounters, RelayStatus, State, transition

log = logging.getLogger("mongo_outbox.group")


class Worker(Protocol):
    @property
    def fence(self) -> int | None: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def published(self) -> int: ...

    async def run(self) -> None: ...

    def stop(self) -> None: ...


class PollingWorker:
    """One partition's polling rounds: stands by until it holds the partition lease, then
    publishes until stopped or the lease is lost (then stands by again). It reports its state
    and its partition's backlog to the metrics as ``GROUP/PARTITION``, as a change-stream
    member's partition relay does, so that a partition nobody publishes shows."""

    def __init__(
        self,
        group: str,
        partition: int,
        lease: FencedLease,
        rounds: Rounds,
        interval: float,
        database: str,
    ) -> None:
        self.group = group
        self.partition = partition
        self.lease = lease
        self.rounds = rounds
        self.interval = interval
        self.name = f"{group}/{partition}"
        self.state: State = "starting"
        self._gauges = metrics.RelayGauges(self.name, database, partition)
        self._stopping = asyncio.Event()

    @property
    def fence(self) -> int | None:
        return self.lease.fence

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def published(self) -> int:
        return self.rounds.stats.published

    def stop(self) -> None:
        self._stopping.set()

    async def status(self) -> RelayStatus:
        """The partition's backlog and this worker's state, as a relay's ``status()``."""
        return await self.rounds.status(self.name, lambda: (self.state, self.state == "active"))

    def _enter(self, state: State, reason: str) -> None:
        self.state = self._gauges.state = transition(log, self.name, self.state, state, reason)

    async def run(self) -> None:
        try:
            async with self._gauges.refreshing(self.status):
                await self._run()
        finally:
            self._enter("stopped", "the member stopped or left the partition")

    async def _run(self) -> None:
        # A partition given back is released at once: look for it often, however long the lease.
        standby = min(self.lease.lease.total_seconds() / 4, 1.0)
        failures = 0
        try:
            while not self._stopping.is_set():
                try:
                    if not await self.lease.acquire():
                        self._enter("standby", "another member holds the partition")
                        await pause(self._stopping, standby)
                        continue
                    self._enter("active", f"holds the partition, fence {self.lease.fence}")
                    log.info(
                        "group %s: partition %d taken, fence %s",
                        self.group,
                        self.partition,
                        self.lease.fence,
                    )
                    margin = self.rounds.settings.publish_timeout
                    async with self.lease.renewed(margin) as lost:
                        await self._publish(lost)
                    self._enter("standby", "the partition lease was lost or given back")
                    failures = 0
                except PyMongoError as error:
                    self._enter("standby", describe(error))
                    failures += 1
                    delay = self.rounds.settings.backoff.delay(failures)
                    log.warning(
                        "group %s: partition %d: %s; retrying in %.1fs",
                        self.group,
                        self.partition,
                        describe(error),
                        delay,
                    )
                    await pause(self._stopping, delay)
        except asyncio.CancelledError:
            self.lease.fence = None  # a crash: no more writes, the lease runs out
            raise
        with contextlib.suppress(PyMongoError):
            await self.lease.release()  # the next holder need not wait for it to run out

    async def _publish(self, lost: asyncio.Event) -> None:
        while not self._stopping.is_set():
            # Fenced: no claim is made once the lease is lost (a renewal failed or ran late).
            if lost.is_set() or self.lease.fence is None:
                log.warning("group %s: partition %d lease lost", self.group, self.partition)
                return
            # A stop (or the partition given back) ends the round before its next wave too.
            _, more = await self.rounds.one(lost=AnyOf(lost, self._stopping))
            if not more:
                await pause(self._stopping, self.interval)


class PartitionRelay(Protocol):
    """What a stream worker runs: a ``ChangeStreamRelay`` ``$match``-ed on its partition, which
    ``group`` makes; the workers need no more of it than this."""

    @property
    def checkpoint(self) -> FencedLease: ...

    @property
    def stats(self) -> RelayCounters: ...

    async def run(self) -> None: ...

    def stop(self) -> None: ...


class StreamWorker:
    """One partition's change-stream relay (its own checkpoint and lease)."""

    def __init__(self, relay: PartitionRelay) -> None:
        self.relay = relay
        self._stopping = False

    @property
    def fence(self) -> int | None:
        return self.relay.checkpoint.fence

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def published(self) -> int:
        return self.relay.stats.published

    def stop(self) -> None:
        self._stopping = True
        self.relay.stop()

    async def run(self) -> None:
        await self.relay.run()
