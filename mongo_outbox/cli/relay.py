"""``mongo-outbox relay``: a relay as a service.

Everything that can be wrong with its configuration is found before it relays anything, and
told in one line with a non-zero exit: the settings, the template (rendered against a sample
event), MongoDB and the broker (each must answer within seconds), and for the change-stream
relay whether the server serves change streams. SIGTERM or SIGINT stops it cleanly: it
finishes its round, gives its lease up and exits 0; a second signal, or a stop that takes
longer than ``--stop-timeout``, cancels it (an active relay's lease then runs out) and exits 1,
saying which. A signal while it still connects stops it there (exit 0: it held nothing yet).
A signal once the relay has ended is ignored: it only closes its connections.

``--metrics-port`` serves Prometheus metrics and a health endpoint (``cli.metrics``); a relay
that failed then keeps them up for ``--metrics-linger`` seconds (150 by default: two scrapes
at Prometheus' default 1 m interval; or until a signal) before it exits 1, so that a probe and
the scrapes see the failure.

``--drain`` publishes what is due now, with a progress line, and exits: for a one-off job (after
an outage, before a migration) where no relay runs. It sweeps the collections, so it needs no
change streams, and takes no lease: claims keep it and running relays from publishing an entry
twice at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import signal
from typing import Any

import click
from click.core import ParameterSource
from pymongo.errors import OperationFailure, PyMongoError

from mongo_outbox.changestream import ChangeStreamRelay, WatchSource
from mongo_outbox.cli.brokers import Broker, broker_options, sample_event
from mongo_outbox.cli.common import (
    Failure,
    Target,
    connected,
    env,
    one_line,
    option,
    run,
    say,
    target_options,
)
from mongo_outbox.cli.metrics import Endpoint, check_extra
from mongo_outbox.cli.progress import progress
from mongo_outbox.errors import ChangeStreamError, ConfigurationError, OutboxError
from mongo_outbox.group import RelayGroup
from mongo_outbox.outbox import Outbox
from mongo_outbox.relay import PollingRelay
from mongo_outbox.settings import RelaySettings, check_count, check_seconds
from mongo_outbox.tenants import TenantRelays, for_database

log = logging.getLogger("mongo_outbox.cli")

# What the command can run: the one relay of its options, or one per database (tenants).
Supervised = PollingRelay | ChangeStreamRelay | RelayGroup | TenantRelays


def _default(relay: type, parameter: str) -> float:
    """A relay's own default, so that the command line's cannot drift from the library's."""
    return float(inspect.signature(relay).parameters[parameter].default)


# The change-stream relay's leader lease and a group member's lease are defaults of their own:
# a member's must leave room for a publish within it (at least 2.5 times the publish timeout).
LEADER_LEASE = _default(ChangeStreamRelay, "leader_lease")
MEMBER_LEASE = _default(RelayGroup, "member_lease")

# Prometheus' default scrape interval. A failed relay serves its failure for two and a half of
# them, so that at least two scrapes see it whatever their phase (15 s let about three
# failures in four go unscraped at 1 m), and OutboxRelayFailed fires on it.
SCRAPE_INTERVAL = 60.0
METRICS_LINGER = 2.5 * SCRAPE_INTERVAL


@click.command()
@target_options
@broker_options
@option("--polling", is_flag=True, help="Run a polling relay instead of the change-stream relay.")
@option(
    "--databases",
    help="Relay the outbox of each of these databases (comma-separated; tenants) in this one "
    "process, instead of --db's.",
)
@option("--name", default="outbox-relay", show_default=True, help="The relay's name.")
@option("--checkpoints", default="outbox_relays", show_default=True, help="Relays' checkpoints.")
@option("--batch-size", type=int, default=100, show_default=True, help="Entries per round.")
@option("--max-attempts", type=int, default=10, show_default=True, help="Failures before parking.")
@option("--claim-lease", type=float, default=30.0, show_default=True, help="Seconds a claim holds.")
@option("--publish-timeout", type=float, default=10.0, show_default=True, help="Seconds per ack.")
@option("--interval", type=float, default=1.0, show_default=True, help="Polling: idle seconds.")
@option(
    "--max-wait",
    type=float,
    default=0.05,
    show_default=True,
    help="Seconds a change-stream batch waits.",
)
@option(
    "--leader-lease",
    type=float,
    help="Seconds the change-stream relay's leader lease lasts without renewal "
    f"[default: {LEADER_LEASE:g}].",
)
@option(
    "--member-lease",
    type=float,
    help="With --partitions: seconds a member's heartbeat and partition leases last without "
    f"renewal [default: {MEMBER_LEASE:g}].",
)
@option("--sweep-interval", type=float, default=30.0, show_default=True, help="Seconds.")
@option("--stop-timeout", type=float, default=10.0, show_default=True, help="Seconds to stop.")
@option(
    "--partitions",
    type=int,
    default=None,
    help="Run as a member of relay group --name over an outbox of this many partitions "
    "(the writers' count; recorded for all of them if none is yet); --member-lease is the "
    "member's lease.",
)
@option(
    "--drain",
    is_flag=True,
    help="Publish what is due now, then exit (a one-off job) instead of relaying until a signal.",
)
@option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve /metrics (Prometheus) and /healthz on this port (0: any free port, logged).",
)
@option("--metrics-host", default="0.0.0.0", show_default=True, help="Address to serve them on.")
@option(
    "--metrics-linger",
    type=float,
    default=METRICS_LINGER,
    show_default=True,
    help="Seconds a failed relay keeps serving them (/healthz: 503) before it exits: at least "
    "twice the scrape interval, so that a scrape sees the failure.",
)
def relay(
    target: Target,
    broker: Broker,
    polling: bool,
    databases: str | None,
    drain: bool,
    metrics_port: int | None,
    metrics_host: str,
    metrics_linger: float,
    **settings: Any,
) -> None:
    """Publish the outbox's events until SIGTERM or SIGINT (with --drain: what is due now)."""
    if drain and settings.get("partitions") is not None:
        raise Failure(
            "--drain and --partitions exclude each other: a drain publishes every partition "
            "at once, run it without --partitions"
        )
    if metrics_port is not None:
        check_extra()
    _check_kind(polling)
    if target.mode == "collection" and target.collections:
        # Not refused (scripts pass one set of options to both modes), but said: a relay of an
        # embedded outbox started in collection mode publishes nothing and sees nothing pending.
        log.warning(
            "--collections (%s) is for --mode embedded: this relay publishes the outbox "
            "collection %r (collection mode); add --mode embedded (%s) if the events are in "
            "the aggregates",
            ",".join(target.collections),
            target.outbox_collection,
            env("--mode"),
        )
    names = _databases(target, databases)
    if names:
        target = dataclasses.replace(target, db=names[0])
    plan = _plan(target, broker, polling, settings | {"metrics_linger": metrics_linger})
    plan.databases = names
    plan.drain = drain
    endpoint = Endpoint(metrics_host, metrics_port) if metrics_port is not None else None
    try:
        run(_serve(plan, endpoint))
    finally:
        # The relay has ended and the process exits: a late signal (the second of a double
        # Ctrl-C) has nothing left to stop, and must not kill the exit half-way.
        for received in (signal.SIGTERM, signal.SIGINT):
            signal.signal(received, signal.SIG_IGN)
        if endpoint is not None:
            endpoint.close()


def _check_kind(polling: bool) -> None:
    """Refuse a tuning option of the other kind of relay given on the command line: it would be
    silently unused. (An environment twin may serve both kinds from one file: not refused.)"""
    context = click.get_current_context()
    others = ("interval",) if not polling else ("max_wait", "sweep_interval")
    given = [
        "--" + name.replace("_", "-")
        for name in others
        if context.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]
    if given:
        kind, own = (
            ("a polling relay (--polling)", "--interval")
            if polling
            else ("a change-stream relay", "--max-wait and --sweep-interval")
        )
        raise Failure(f"{' and '.join(given)} would be unused: {kind} tunes {own}")


class _Plan:
    """Everything the relay needs, checked before any connection is made."""

    def __init__(self, target: Target, broker: Broker, polling: bool, given: dict[str, Any]):
        self.target, self.broker, self.polling = target, broker, polling
        self.name: str = given["name"]
        self.checkpoints: str = given["checkpoints"]
        self.settings = RelaySettings(
            batch_size=given["batch_size"],
            max_attempts=given["max_attempts"],
            claim_lease=given["claim_lease"],
            publish_timeout=given["publish_timeout"],
        )
        self.interval = check_seconds(given["interval"], "--interval")
        self.max_wait = check_seconds(given["max_wait"], "--max-wait")
        self.partitions: int | None = given.get("partitions")
        leader_lease, member_lease = given["leader_lease"], given["member_lease"]
        # Each lease is its own relay's: one given to the other kind would be silently unused.
        if self.partitions is None and member_lease is not None:
            raise Failure("--member-lease is a group member's lease: give --partitions too")
        if polling and self.partitions is None and leader_lease is not None:
            raise Failure(
                "--leader-lease is the change-stream relay's lease: a polling relay (--polling) "
                "holds none (its claims are its leases, --claim-lease)"
            )
        if self.partitions is not None and leader_lease is not None:
            raise Failure(
                "--leader-lease is the change-stream relay's lease; a group member's (with "
                "--partitions) is --member-lease"
            )
        self.leader_lease = check_seconds(
            LEADER_LEASE if leader_lease is None else leader_lease, "--leader-lease"
        )
        self.member_lease = check_seconds(
            MEMBER_LEASE if member_lease is None else member_lease, "--member-lease"
        )
        self.sweep_interval = check_seconds(given["sweep_interval"], "--sweep-interval")
        self.stop_timeout = check_seconds(given["stop_timeout"], "--stop-timeout")
        self.linger = check_seconds(given["metrics_linger"], "--metrics-linger", zero=True)
        if self.partitions is not None:
            check_count(self.partitions, "--partitions")
            if self.member_lease < 2.5 * self.settings.publish_timeout:
                raise ConfigurationError(
                    f"a group member's lease ({self.member_lease:g} s) must be at least 2.5 "
                    f"times --publish-timeout ({self.settings.publish_timeout:g} s)",
                    setting="--member-lease",
                )
        self.sample = sample_event(target.collections)
        broker.check(self.sample)
        self.databases: tuple[str, ...] = ()
        self.drain = False

    def relay(
        self, outbox: Outbox, publisher: Any
    ) -> PollingRelay | ChangeStreamRelay | RelayGroup:
        if self.partitions is not None:
            partitioned = Outbox(
                outbox.db,
                mode=outbox.mode,
                collection=outbox.collection.name,
                collections=outbox.collections,
                partitions=self.partitions,
            )
            return RelayGroup(
                partitioned,
                publisher,
                name=self.name,
                source="polling" if self.polling else "changestream",
                settings=self.settings,
                member_lease=self.member_lease,
                interval=self.interval,
                checkpoints=self.checkpoints,
            )
        if self.polling:
            return PollingRelay(
                outbox, publisher, settings=self.settings, interval=self.interval, name=self.name
            )
        return ChangeStreamRelay(
            outbox,
            publisher,
            name=self.name,
            settings=self.settings,
            max_wait=self.max_wait,
            leader_lease=self.leader_lease,
            sweep_interval=self.sweep_interval,
            checkpoints=self.checkpoints,
        )


def _databases(target: Target, given: str | None) -> tuple[str, ...]:
    if given is None:
        return ()
    if target.db:
        raise Failure("--db and --databases exclude each other: name the databases once")
    names = tuple(name.strip() for name in given.split(",") if name.strip())
    if not names:
        raise Failure("--databases names no database")
    if len(set(names)) != len(names):
        raise Failure(f"--databases names a database twice: {given}")
    return names


def _plan(target: Target, broker: Broker, polling: bool, given: dict[str, Any]) -> _Plan:
    try:
        return _Plan(target, broker, polling, given)
    except ConfigurationError as error:
        # RelaySettings.claim_lease -> --claim-lease: say it as it was given.
        flag = "--" + (error.setting or "").rsplit(".", 1)[-1].lstrip("-").replace("_", "-")
        raise Failure(f"bad {flag}: {error}") from None


async def _serve(plan: _Plan, endpoint: Endpoint | None) -> None:
    # The handlers go in before the first connection: a signal while the relay connects (or
    # declares its exchange) must stop it cleanly too, not kill it with the default action.
    signals = _Signals(plan.name, plan.stop_timeout)
    try:
        await _connect_and_run(plan, endpoint, signals)
    except asyncio.CancelledError as cancelled:
        if not signals.interrupted_start:
            raise
        if isinstance(cancelled.__context__, (Failure, OutboxError, PyMongoError)):
            # It was failing already, and the signal came while it cleaned up: say why.
            raise cancelled.__context__ from None
        received = signals.received[0].name
        if signals.draining:
            raise Failure(
                f"relay {plan.name}: {received} received: the drain stopped; what it had "
                "claimed is published again once its claims run out"
            ) from None
        if plan.drain:  # a job that did not run has failed, whatever stopped it
            raise Failure(
                f"relay {plan.name}: {received} received before the drain started"
            ) from None
        log.info("relay %s: %s received before it started: stopped", plan.name, received)
    finally:
        signals.ignore()


async def _connect_and_run(plan: _Plan, endpoint: Endpoint | None, signals: _Signals) -> None:
    async with connected(plan.target, service=True) as conn:
        outboxes = [conn.outbox]
        if plan.databases:
            outboxes = [plan.target.outbox(conn.client[name]) for name in plan.databases]
        for outbox in outboxes:
            await _check_exists(outbox)
        if not plan.polling and not plan.drain:  # a drain sweeps: no change stream needed
            for outbox in outboxes:
                await _check_change_streams(outbox)
        publisher = await plan.broker.connect(plan.sample)
        try:
            relays = [plan.relay(outbox, publisher) for outbox in outboxes]
            for outbox in outboxes:
                log.info(
                    "relay %s: %s relay of %s to %s",
                    plan.name,
                    "polling" if plan.polling else "change-stream",
                    plan.target.describe(outbox.db.name),
                    plan.broker.describe(),
                )
            signals.check()
            if plan.drain:
                signals.draining = True
                drained = [r for r in relays if not isinstance(r, RelayGroup)]
                await _drain(drained, tenants=bool(plan.databases))
                signals.ignore()  # it is done: a signal now must not fail it
                return
            # One publisher connection serves every database's relay.
            relay = TenantRelays(relays) if plan.databases else relays[0]
            await _supervise(relay, plan, endpoint, signals)
        finally:
            await publisher.aclose()


async def _drain(relays: list[PollingRelay | ChangeStreamRelay], tenants: bool) -> None:
    """Publish what is due now in each database, one after another, with a progress line;
    with ``tenants`` (``--databases``) each database's lines say which it is."""

    def published() -> int:
        return sum(relay.stats.published for relay in relays)

    pending = [(await relay.status()).pending for relay in relays]
    async with progress("drain", "events", total=sum(pending), follow=published):
        for relay in relays:
            with for_database(relay.outbox.db.name) if tenants else contextlib.nullcontext():
                await relay.drain()
    left = sum([(await relay.status()).pending for relay in relays])
    failed = sum(relay.stats.failed for relay in relays)
    said = f"published {published()} events"
    if failed:
        said += f"; {failed} publishes failed (mongo-outbox status, parked list)"
    say(f"{said}; {left} pending (due later, waiting for a retry, or saved meanwhile)")
    parked = sum(relay.stats.parked for relay in relays)
    if parked or (failed and left):
        # A job (cron, a deploy step) must tell a drain that could not publish everything from
        # one that did (a failure retried and published within the drain is no failure of it).
        raise Failure(
            f"the drain published {published()} events and {failed} publishes failed: "
            f"{parked} parked, the rest pending for their next attempt"
        )


async def _check_exists(outbox: Outbox) -> None:
    """Warn of an outbox with no collection yet: a misspelled --db or tenant is relayed (and
    watched) for ever in silence, where a new deployment only has not written yet."""
    wanted = [outbox.collection.name] if outbox.mode == "collection" else outbox.collections
    try:
        found = await outbox.db.list_collection_names(
            filter={"name": {"$in": list(wanted)}}, authorizedCollections=True
        )
    except OperationFailure as error:  # a user without listCollections: it is only a warning
        log.debug("relay: cannot list the collections of %s: %s", outbox.db.name, error)
        return
    if not found:
        log.warning(
            "database %s has none of %s yet: relaying it all the same (a misspelled --db or "
            "--databases? else nothing was written there yet)",
            outbox.db.name,
            ", ".join(wanted),
        )


async def _check_change_streams(outbox: Outbox) -> None:
    try:
        stream = await WatchSource.for_outbox(outbox).open()
    except PyMongoError as error:
        raise Failure(
            f"this MongoDB serves no change streams ({one_line(error)}): use a replica set, "
            "or run the relay with --polling"
        ) from None
    await stream.aclose()


class _Signals:
    """SIGTERM and SIGINT, from the first connection to the exit.

    Before the relay runs, a signal cancels the start-up (nothing is held yet), and during a
    drain the drain (its claims run out); a second one ends the process at once, whatever it
    waits for. Once the relay runs, the first asks it to stop and the second (or
    ``--stop-timeout``) cancels it. After it ended, signals are only logged: closing the
    connections must not be interrupted.
    """

    def __init__(self, name: str, stop_timeout: float) -> None:
        self.name, self.stop_timeout = name, stop_timeout
        self.loop = asyncio.get_running_loop()
        self.starting = asyncio.current_task()
        self.received: list[signal.Signals] = []
        self.draining = False  # a --drain, whose relay runs in the start-up task
        self.relay: Supervised | None = None
        self.task: asyncio.Future[None] | None = None
        self.lingering = asyncio.Event()
        # Why the relay was cancelled, and its state then (what it held), for the last line.
        self.forced: list[tuple[str, str]] = []
        for received in _SIGNALS:
            self.loop.add_signal_handler(received, self.on_signal, received)

    def watch(self, relay: Supervised, task: asyncio.Future[None]) -> None:
        self.relay, self.task = relay, task

    @property
    def interrupted_start(self) -> bool:
        """A signal came before the relay ran (or during a drain, which runs in the start-up)."""
        return bool(self.received) and self.task is None

    def check(self) -> None:
        """Stop here if a signal came while it started: a cancellation can be swallowed by
        what it interrupted (a ``wait_for`` whose call finished in the same turn, on 3.10)."""
        if self.interrupted_start:
            raise asyncio.CancelledError

    def on_signal(self, received: signal.Signals) -> None:
        relay, task = self.relay, self.task
        if relay is None or task is None:
            if self.received:
                # Asked twice while it starts or drains: whatever it is waiting for, stop now.
                log.warning("relay %s: %s again: exiting at once", self.name, received.name)
                self.loop.remove_signal_handler(received)
                signal.signal(received, signal.SIG_DFL)
                signal.raise_signal(received)
                return
            if self.starting is not None:
                self.received.append(received)
                self.starting.cancel()
            return
        # Whatever the relay is doing, a signal ends a linger that follows: one that came while
        # a failed relay still closed its connections (/healthz said "failed" already) was
        # taken as a stop, and the linger then waited its whole --metrics-linger.
        self.lingering.set()
        if task.done():
            return
        if self.received:
            log.warning("relay %s: %s again: cancelling", self.name, received.name)
            self.force(f"a second signal ({received.name}) came before it stopped")
            return
        self.received.append(received)
        log.info(
            "relay %s: %s received: stopping and giving the lease up", self.name, received.name
        )
        relay.stop()
        self.loop.call_later(
            self.stop_timeout, self.force, f"it did not stop within {self.stop_timeout:g}s"
        )

    def force(self, why: str) -> None:
        if self.relay is not None and self.task is not None and not self.task.done():
            self.forced.append((why, _left_behind(self.relay, self.relay.state)))
            self.task.cancel()

    def ignore(self) -> None:
        # The relay has ended; closing its connections follows, briefly. A signal now (the
        # second of a double Ctrl-C) has nothing left to stop: it must not interrupt the
        # shutdown with a KeyboardInterrupt. The handlers go with the event loop.
        for received in _SIGNALS:
            self.loop.add_signal_handler(received, _ignored, self.name, received)


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def _supervise(
    relay: Supervised, plan: _Plan, endpoint: Endpoint | None, signals: _Signals
) -> None:
    name = plan.name
    task = asyncio.ensure_future(relay.run())
    signals.watch(relay, task)
    if endpoint is not None:
        endpoint.state = lambda: _state(relay, task)
    try:
        await asyncio.wait({task})
        if endpoint is not None and plan.linger and _state(relay, task) == "failed":
            log.warning(
                "relay %s failed: /healthz answers 503 for %gs (--metrics-linger), then it exits",
                name,
                plan.linger,
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(signals.lingering.wait(), plan.linger)
    finally:
        signals.ignore()
    if task.cancelled():
        why, left = signals.forced[0] if signals.forced else ("it was cancelled", "")
        left = left or _left_behind(relay, relay.state)
        raise Failure(f"relay {name} was cancelled: {why}; {left}")
    error = task.exception()
    if isinstance(error, (ChangeStreamError, ConfigurationError)):
        raise Failure(f"relay {name} failed: {one_line(error)}")
    if error is not None:
        raise error
    log.info("relay %s: stopped", name)


def _ignored(name: str, received: signal.Signals) -> None:
    log.info("relay %s: %s received while exiting: already stopped", name, received.name)


def _left_behind(relay: Supervised, state: str) -> str:
    """What a cancelled relay leaves for others to wait out, by what it held when cancelled."""
    if isinstance(relay, PollingRelay):
        return "the events it had claimed are published again once their claims run out"
    # Backing off after an error, a change-stream relay stands by with its lease still held.
    if state == "active" or (isinstance(relay, ChangeStreamRelay) and relay.may_hold_lease):
        return "its lease runs out, then a standby takes over"
    return f"it held no lease ({state})"


def _state(relay: Supervised, task: asyncio.Future[None]) -> str:
    """The relay's state for ``/healthz``: a run that raised has failed, whatever the relay
    object last recorded."""
    if task.done() and not task.cancelled() and task.exception() is not None:
        return "failed"
    return relay.state
