"""ChangeStreamRelay: publishes outbox entries within milliseconds of their commit.

It follows a change stream (collection mode: inserts on the outbox collection; embedded mode:
writes to the aggregate collections that leave entries in their outbox array) and keeps, in a
checkpoint collection keyed by relay name, the resume token up to which every event is confirmed
by the broker and marked published. The outbox documents stay the truth: on first start, and
whenever the token cannot be used (history lost, invalid token, invalidate, drop or rename), the
relay captures a cluster time, sweeps what is pending from the collections themselves, then
watches from that time. One relay per name is active: a leader lease in the checkpoint document,
renewed in the background while the relay works, with a fencing token that every checkpoint
write must still match (see ``_relay.lease``). The moment a renewal fails, publishing stops.

Publishing, ordering, retries and parking are the polling relay's (``_relay.rounds``); every outbox
query goes through the store: the stream only tells the relay what to claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pymongo.errors import NetworkTimeout, PyMongoError, ServerSelectionTimeoutError

from mongo_outbox import metrics
from mongo_outbox._driver import answered
from mongo_outbox._relay.lease import FencedLease, LeaseLost
from mongo_outbox._relay.lifecycle import Lifecycle
from mongo_outbox._relay.rounds import AnyOf, Rounds, pause
from mongo_outbox.admin import OutboxAdmin
from mongo_outbox.brokers._publishing import Publisher
from mongo_outbox.changestream.source import (
    ENDS_STREAM,
    ChangeBatch,
    ChangeSource,
    ChangeStream,
    WatchSource,
    triage,
)
from mongo_outbox.errors import ChangeStreamError, ConfigurationError, describe
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
from mongo_outbox.status import RelayCounters, RelayStatus

if TYPE_CHECKING:
    from mongo_outbox._relay.turns import Turns

log = logging.getLogger(__name__)
T = TypeVar("T")

ABANDON_WAIT = 1.0
"""Seconds a stop gives the stream's read under way to end, beyond ``max_wait``, before it
cancels it, and then again for the cancellation to end it: past both (a server that does not
answer) the stream is dropped without a close, which would run beside the read."""
RELEASE_WAIT = 2.0
"""Seconds a stopping relay tries to give up its lease (or one it may hold without knowing: the
answer to its last attempt was lost), or to save its last checkpoint, before it leaves the
lease to run out (and a restart to replay a little)."""


class ChangeStreamRelay(Lifecycle):
    """Publishes an outbox by following its change stream.

    Parameters:
        outbox: the Outbox to relay, in either mode.
        publisher: any Publisher.
        name: the relay's name: its checkpoint, and the leader lease that one process holds.
        source: where changes come from; default ``WatchSource.for_outbox(outbox)``.
        settings: entries per round, in-flight window, timeouts, claim lease, attempts, backoff.
        max_wait: the longest a batch waits for more changes. A batch takes what the stream
            has already delivered and closes as soon as that runs out (a lone change is
            published at once; a burst makes large batches), or at ``settings.batch_size``
            changes, or after this long under a steady trickle.
        leader_lease: how long the active relay holds its lease without renewing it (it renews
            every third of it); a standby takes over within about 1.25 times this after the
            leader died, a quarter of it after its ``stop()``.
        sweep_interval: longest time between sweeps of the collections (for requeued entries,
            retries that came due, anything the stream missed).
        checkpoints: the checkpoint collection, in the outbox's database.
        partition: publish only this partition of an outbox with ``partitions`` (its stream
            ``$match``-es the partition; ``RelayGroup`` runs one per partition it holds).
    """

    def __init__(
        self,
        outbox: Outbox,
        publisher: Publisher,
        *,
        name: str,
        source: ChangeSource | None = None,
        settings: RelaySettings | None = None,
        max_wait: Duration = 0.05,
        leader_lease: Duration = 15.0,
        sweep_interval: Duration = 30.0,
        checkpoints: str = "outbox_relays",
        partition: int | None = None,
    ) -> None:
        name = check_name(name, "ChangeStreamRelay.name")
        self._gauges = metrics.RelayGauges(name, outbox.db.name, partition, recovers=True)
        super().__init__(name, log, self._gauges)
        self.settings = check_relay_settings(settings, "ChangeStreamRelay.settings")
        if partition is not None and (
            isinstance(partition, bool)
            or not isinstance(partition, int)
            or not 0 <= partition < outbox.partitions
        ):
            raise ConfigurationError(
                f"ChangeStreamRelay.partition must be None or one of the outbox's partitions "
                f"(0 to {outbox.partitions - 1}), not {partition!r}",
                setting="ChangeStreamRelay.partition",
            )
        outbox.check_relay_collection(checkpoints, "ChangeStreamRelay.checkpoints")
        self.max_wait = check_seconds(max_wait, "ChangeStreamRelay.max_wait")
        self.leader_lease = check_timedelta(leader_lease, "ChangeStreamRelay.leader_lease")
        self.sweep_interval = check_seconds(sweep_interval, "ChangeStreamRelay.sweep_interval")
        self.outbox = outbox
        self.publisher = publisher
        self.source: ChangeSource = source or WatchSource.for_outbox(outbox, partition=partition)
        self.checkpoint = FencedLease(outbox.db[checkpoints], name, self.leader_lease)
        self._rounds = Rounds(outbox, publisher, self.settings, partition, relay=name)
        lease = self.leader_lease.total_seconds()
        self._rounds.command_wait = max(self._rounds.command_wait, lease)
        self.recoveries = 0
        self._opened_by_sweep = 0  # streams opened after a sweep (recoveries and first starts)
        self._sweep_due = 0.0
        self._saved_at = float("-inf")
        self._lost = asyncio.Event()
        self._getting: asyncio.Future[Any] | None = None  # the stream's read under way
        self._failures = 0  # stream errors in a row: the backoff's attempt
        self._following_since: float | None = None  # since when the stream answers
        # How long following without an error makes the next error a first one again.
        self._steady = self.leader_lease.total_seconds()
        # Whether the lease in the database may be this object's: only then does a stop give it
        # up, so that a standby stops at once during a MongoDB outage instead of waiting on a
        # release it does not need.
        self._may_hold = False

    # -- public API ---------------------------------------------------------------------------

    async def drain(self) -> int:
        """Publish everything pending now (a sweep of the collections); return how many."""
        with self._exclusive("drain()"):
            return await self._rounds.drain()

    async def run(self) -> None:
        """Relay until ``stop()`` (also one called before ``run()`` started) or cancellation:
        stand by until this process holds the lease, then follow the stream. Resumable errors
        resume from the checkpoint with backoff; an error no retry can fix raises
        ChangeStreamError. ``stop()`` gives the lease up."""
        with self._running():
            # Cancellation stands for a crash (the lease runs out); anything else gives it up.
            cancelled = False
            try:
                async with self._gauges.refreshing(self.status):
                    await self._relay()
            except asyncio.CancelledError:
                cancelled = True
                self.checkpoint.fence = None  # no more writes; the lease in the database runs out
                raise
            finally:
                if not cancelled:
                    await self._release()

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

    async def status(self) -> RelayStatus:
        doc = await self.checkpoint.load()
        return await self._rounds.status(
            self.name,
            lambda: (self.state, self.state == "active" and not self._lost.is_set()),
            checkpoint_at=doc.get("checkpoint_at"),
            recoveries=self.recoveries,
            last_error=lambda: self.last_error,
        )

    async def parked(self) -> list[dict[str, Any]]:
        """Parked entries, with their ``last_error``: see
        ``PollingRelay.parked()``."""
        # As every operator's tool reads them: through the outbox's admin, read whole.
        page = await OutboxAdmin(self.outbox).parked(whole=True)
        return [dict(entry.document) for entry in page.entries]

    async def requeue(self, event_ids: Sequence[str]) -> int:
        """Make parked entries pending again, with a fresh set of attempts (see
        ``PollingRelay.requeue()``); the active relay's next sweep publishes them (this one's
        at once). Returns how many were requeued."""
        requeued = await OutboxAdmin(self.outbox).requeue(event_ids)
        self._sweep_due = 0.0
        return requeued

    # -- leadership ---------------------------------------------------------------------------

    async def _acquire(self) -> bool | None:
        """Take (or renew) the lease; None when ``stop()`` came first (the stop then gives up
        a lease this relay may hold, for RELEASE_WAIT)."""
        renewing = self.checkpoint.fence is not None
        self._may_hold = True  # until the server's answer says otherwise
        # Bounded: a hung connection must not hold the relay for ever (nor, taken again after
        # an error, keep it from resuming while its lease runs out).
        attempt = asyncio.ensure_future(self._rounds.answered(self.checkpoint.acquire()))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({attempt, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not attempt.done():
            # Not awaited: on Python 3.10 PyMongo finishes its server selection first (30 s).
            attempt.add_done_callback(_retrieved)
            attempt.cancel()
            # Still choosing a server (none is writable): a first attempt was never sent.
            self._may_hold = renewing or self._writable()
            return None
        try:
            held = attempt.result()
        except ServerSelectionTimeoutError:
            self._may_hold = renewing  # no server was chosen: nothing was sent
            raise
        except NetworkTimeout:
            # No answer within the bound: it may have taken the lease, unless no server was
            # chosen to send it to.
            self._may_hold = renewing or self._writable()
            raise
        self._may_hold = held
        return held

    @property
    def may_hold_lease(self) -> bool:
        """Whether the leader lease in the database may be this relay's: what a stop, or a
        crash, leaves to run out."""
        return self._may_hold

    def _writable(self) -> bool:
        client = self.checkpoint.coll.database.client
        try:
            return bool(client.topology_description.has_writable_server())
        except Exception:  # noqa: BLE001 - a client without a topology to ask: assume sent
            return True

    async def _release(self) -> None:
        """Give the lease up if this relay may hold it (or its last attempt's answer was lost).
        It tries for RELEASE_WAIT, then lets the lease run out: a MongoDB out of reach or not
        answering must not hold the stop, and a standby takes over a lease run out as well."""
        if not self._may_hold:
            return
        with contextlib.suppress(PyMongoError, asyncio.TimeoutError):
            await asyncio.wait_for(self.checkpoint.release(), RELEASE_WAIT)
            self._may_hold = False

    async def _relay(self) -> None:
        loop = asyncio.get_running_loop()
        self._failures = 0
        while not self._stopping.is_set():
            try:
                held = await self._acquire()
                if held is None:
                    break
                if not held:
                    self._enter("standby", "another process holds the lease")
                    await pause(self._stopping, self.leader_lease.total_seconds() / 4)
                    continue
                self._enter("active", f"holds the lease, fence {self.checkpoint.fence}")
                async with self.checkpoint.renewed() as self._lost:
                    await self._follow()
            except LeaseLost as error:
                self._enter("standby", str(error))
            except ChangeStreamError as error:
                self._fail(error)  # before the lease is given up: a probe sees it failed at once
                raise
            except PyMongoError as error:
                since = self._following_since
                if since is not None and loop.time() - since >= self._steady:
                    # It followed the stream a while before this: a blip, not the same error
                    # again (a persistent one, after each reopen, keeps backing off further).
                    self._failures = 0
                self._following_since = None
                self._failures += 1
                delay = self.settings.backoff.delay(self._failures)
                self.last_error = describe(error)
                # Not publishing, and its lease no longer renewed: another relay may take it.
                self._enter("standby", f"resuming from the checkpoint in {delay:.1f}s")
                log.warning(
                    "relay %s: %s; resuming from the checkpoint in %.1fs",
                    self.name,
                    self.last_error,
                    delay,
                )
                await pause(self._stopping, delay)

    @property
    def _halted(self) -> AnyOf:
        """What ends a round before its next wave: the lease it needs is gone, or a stop (with a
        slow broker, a round of many waves outlasted a service's stop timeout); settle releases
        the rest, due at once, for a sweep here or after the restart."""
        return AnyOf(self._lost, self._stopping)

    def _check_lease(self) -> None:
        if self._lost.is_set():
            self._enter("standby", "the leader lease could not be renewed")
            raise LeaseLost(f"relay {self.name}: the leader lease was lost")

    # -- following ----------------------------------------------------------------------------

    async def _follow(self) -> None:
        loop = asyncio.get_running_loop()
        self._saved_at = float("-inf")
        swept = self._opened_by_sweep
        stream = await self._open(
            (await self._rounds.answered(self.checkpoint.load())).get("token")
        )
        self._following_since = None
        # The token after the last batch handled, and whether it passed changes since the last
        # save: batches close as soon as the stream runs dry, so under a trickle they hold one
        # change each, and one checkpoint write per batch would triple the database's work.
        # Changes are saved at most once per max_wait; a restart replays what was published
        # since, which the claim finds published already.
        token: Any = None
        changed = False
        try:
            if self._opened_by_sweep == swept:
                # Resumed: the token may have moved past entries left due (a publish that
                # failed, another relay's claim); they come due at their own time, not a sweep
                # later. An opening sweep (a recovery's, a first start's) scheduled the next.
                await self._schedule_sweep()
            while not self._stopping.is_set():
                self._check_lease()
                try:
                    batch = await self._unless_stopped(self._next_batch(stream))
                except PyMongoError as error:
                    self._fail_unless_recoverable(error)
                    await _close(stream)
                    stream = await self._recover(f"the change stream cannot resume ({error})")
                    token, changed = None, False
                    continue
                if batch is None:
                    break  # stopped while waiting, maybe for a server: nothing was handled
                if self._following_since is None:
                    self._following_since = loop.time()  # the stream answers again
                ended = [c for c in batch.changes if c["operationType"] in ENDS_STREAM]
                await self._handle(
                    [c for c in batch.changes if c["operationType"] not in ENDS_STREAM]
                )
                self._check_lease()
                if ended:
                    await _close(stream)
                    stream = await self._recover(f"{ended[0]['operationType']} event")
                    token, changed = None, False
                    continue
                if batch.token is not None:
                    token, changed = batch.token, changed or bool(batch.changes)
                now = loop.time()
                # A quiet stream's token moves on too, so the position stays inside the oplog
                # window; the heartbeat renews the lease meanwhile.
                since = now - self._saved_at
                quiet_due = since >= self.leader_lease.total_seconds() / 3
                if token is not None and ((changed and since >= self.max_wait) or quiet_due):
                    await self._rounds.answered(self.checkpoint.save(token))
                    self._saved_at, token, changed = now, None, False
                if await self._rounds.probe():
                    self._sweep_due = 0.0  # a waiting entry was made due: see if the broker is back
                if now >= self._sweep_due:
                    await self._sweep()
            if changed and not self._lost.is_set():
                # Stopping: hand over without a replay, unless MongoDB is out of reach, which
                # the stop does not wait out (a replay is the cost).
                with contextlib.suppress(PyMongoError, asyncio.TimeoutError):
                    await asyncio.wait_for(self.checkpoint.save(token), RELEASE_WAIT)
        finally:
            getting = self._getting
            if getting is not None and not getting.done():
                # Abandoned, waiting for a server: give its cancellation a moment to end it.
                await asyncio.wait({getting}, timeout=ABANDON_WAIT)
            if getting is None or getting.done():
                await _close(stream)
            # Else a read still runs on the stream: closing it beside would make two
            # operations on one cursor. It is dropped; the server ends the cursor in time.

    async def _open(self, token: Any) -> ChangeStream:
        if token is None:
            # Nothing was lost: a first start (or a checkpoint deleted by hand) has no position
            # to resume from. Counted as a recovery, every relay's first start looked like
            # a lost history on the dashboard and in status().
            return await self._recover("no checkpoint yet", lost=False)
        try:
            return await self.source.open(resume_after=token)
        except PyMongoError as error:
            self._fail_unless_recoverable(error)
            return await self._recover(f"the checkpoint's resume token is unusable ({error})")

    def _fail_unless_recoverable(self, error: PyMongoError) -> None:
        """Return if the token is unusable (recover), re-raise a resumable error for run()'s
        backoff, and turn a fatal one into ChangeStreamError."""
        kind = triage(error)
        if kind == "fatal":
            raise ChangeStreamError(
                f"relay {self.name}: the change stream failed: {error}",
                relay=self.name,
                code=getattr(error, "code", None),
            ) from error
        if kind == "resume":
            raise error

    async def _recover(self, reason: str, *, lost: bool = True) -> ChangeStream:
        """Sweep, then watch from the cluster time taken before the sweep. ``lost``: the
        stream's position was lost (a recovery, counted); else there was none yet."""
        self._opened_by_sweep += 1
        if lost:
            self.recoveries += 1
            metrics.recovered(self._gauges.labels)
        log.log(
            logging.WARNING if lost else logging.INFO,
            "relay %s: %s (%s): sweeping the outbox, then watching from the cluster time taken "
            "before the sweep",
            self.name,
            "recovering" if lost else "starting",
            reason,
        )
        start_at = await self.source.cluster_time()
        if start_at is not None:
            await self._sweep()
        try:
            stream = await self.source.open(start_at=start_at)
        except PyMongoError as error:
            if triage(error) == "fatal":
                self._fail_unless_recoverable(error)
            raise  # run() backs off and starts over from the checkpoint
        if start_at is None:
            # No cluster time to watch from: watch from now first, then sweep, which leaves no
            # gap either (what commits after the open is on the stream, the rest is swept).
            try:
                await self._sweep()
            except BaseException:
                await _close(stream)
                raise
        log.info("relay %s: watching from %s", self.name, start_at or "now")
        return stream

    async def _handle(self, changes: list[dict[str, Any]]) -> None:
        if not changes:
            return
        _, recheck = await self._rounds.changes(changes, self._halted)
        if recheck:
            # Some failed, wait behind an earlier entry, are held by another relay's claim, or
            # were published already (a replay after a restart): the sweep settles which.
            recheck_at = asyncio.get_running_loop().time() + min(1.0, self.sweep_interval)
            self._sweep_due = min(self._sweep_due, recheck_at)

    async def _sweep(self) -> int:
        """Publish what is due in the collections; then schedule the next sweep for when the
        earliest entry left behind comes due."""
        total = 0
        # Only what was due when the sweep began: later entries are on the stream, and a sweep
        # chasing a busy writer would never hand over to it.
        until = utc_now()
        while not self._stopping.is_set():
            self._check_lease()
            published, more = await self._rounds.one(until, self._halted)
            total += published
            if not more:
                break
        await self._schedule_sweep()
        return total

    async def _schedule_sweep(self) -> None:
        due = await self._rounds.answered(self._rounds.store.next_due())
        wait = self.sweep_interval
        if due is not None:
            wait = min(max((due - utc_now()).total_seconds(), 1.0), self.sweep_interval)
        self._sweep_due = asyncio.get_running_loop().time() + wait

    async def _next_batch(self, stream: ChangeStream) -> ChangeBatch:
        """The stream's next batch, bounded as a round's commands are (beyond the batch's own
        ``max_wait``): a getMore on a connection hung without a reset waited for ever, while the
        lease's heartbeat, on another connection, kept the lease from any other relay."""
        # A batch's claim is a turn: bounded by the tenant's share, not by time (the sweep's
        # rounds are), which could cut a trickle's batches to one change on a slow server.
        batch = stream.next_batch(self._rounds.limit(timed=False), self.max_wait)
        if not getattr(stream, "interruptible", True):
            return await batch  # Motor's: bounded by the client's socketTimeoutMS, if set
        return await answered(batch, self._rounds.command_wait + self.max_wait)

    async def _unless_stopped(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None if ``stop()`` came first: a command waiting for a server
        during an outage (30 s of server selection) must not hold a stop."""
        task = asyncio.ensure_future(work)
        self._getting = task
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                # A server that answers ends it within max_wait: so the stream is never
                # closed beside it (Motor's runs in a thread a cancel does not stop).
                await asyncio.wait({task}, timeout=self.max_wait + ABANDON_WAIT)
        except BaseException:
            task.cancel()
            raise
        finally:
            stopping.cancel()
            # Its end, once abandoned, is of no interest: a batch it fetched is not handled,
            # and the checkpoint stays before it (a restart replays it).
            task.add_done_callback(_retrieved)
        if task.done():
            return task.result()
        task.cancel()
        return None


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _close(stream: ChangeStream) -> None:
    # A stream that broke may fail to close as well, or wait for a server that does not
    # answer: it is dropped either way.
    with contextlib.suppress(PyMongoError, asyncio.TimeoutError):
        await asyncio.wait_for(stream.aclose(), RELEASE_WAIT)
