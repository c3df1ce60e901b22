"""Model-based test of the relays (a hypothesis state machine), in both outbox modes.

The machine interleaves at random: saves and operator updates (committed, aborted on purpose inside
a transaction, refused by ``expected_version``); a broker that is up, down
(``BrokerUnavailableError``: no attempt counted) or without a route for events of type ``b``
(``BrokerUnavailableError`` with a ``destination``); events that turn bad (``RuntimeError``: an
attempt; ``InvalidEventError``: parked at once) and heal; relay processes, up to three, restarted
by replacing their object: a ``PollingRelay`` publishing a batch or draining, a
``ChangeStreamRelay`` draining, and one ``ChangeStreamRelay`` running, fed change batches one at a
time (fresh inserts and stale replays alike); relays that die, one that claimed through the store
and published a few waves by hand, one cancelled right after its k-th broker confirm; their leases
running out; a stalled relay settling late; operators requeuing parked events; time passing.

Time passes only when the model says so: the backoff and dead relays' leases are an hour, and
``time_passes`` and ``lease_runs_out`` move due times to now, as ``_make_due`` does in
``test_relay.py``. So a step does what the steps before it set up, however long they took (only
the relays' one-second wake and probe timers run on the clock).

Checked at every publication, by the FAKE broker, which reads the database before it confirms:

- the event was committed (not aborted, not refused), and is published unchanged;
- **order**: when an event is published for the first time, every earlier event of its aggregate
  (lower ``sequence``) has been published, or is parked at that moment. This is the documented
  guarantee (docs/relay.md): events of an aggregate go out in sequence order, except that a
  parked event is set aside: its later events go on without it, and after a requeue it arrives
  after them. A requeued event is pending again, so it holds back every later event from then
  on; and while nothing of an aggregate was ever parked, its first publications are exactly its
  committed sequence 1, 2, 3... Only first publications are ordered: a copy published again after
  a lease ran out repeats what went before, and consumers drop it by its id;
- no event goes out while it is parked, or while a dead relay's unexpired claim holds it (its
  entry, or in embedded mode its document), and no aggregate has two events in flight at once.

Checked after every step: nothing published but committed events; a second publication only of
an event that a relay published and died before settling (counted, not forbidden); no claim left
in the outbox but dead relays'; every parked entry is a committed event with a ``last_error``; a
step of a live relay unparks nothing, parks an event at its ``InvalidEventError`` and at its
``max_attempts``-th ``RuntimeError``, parks nothing without a cause of its own (never for an
outage), and records the failure that parked it as ``last_error``; a requeue unparks exactly the
asked events and the earlier parked events of their aggregates; a dead relay parks nothing; no
hot loop: at most ``HOT_LOOP`` publish attempts of one event in one step.

At the end the broker is healthy, every lease runs out, everything parked is requeued, relays
drain until nothing is pending, and every committed event must have been published.

``RELAY_MODEL_EXAMPLES`` (per mode) and ``RELAY_MODEL_STEPS`` (per example) tune the search.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from mongo_outbox import (
    Backoff,
    BrokerUnavailableError,
    ChangeStreamRelay,
    ConcurrencyError,
    Event,
    InvalidEventError,
    Outbox,
    PollingRelay,
    RelaySettings,
)
from mongo_outbox._relay.store import store_for
from mongo_outbox._relay.store.base import Claim
from mongo_outbox.changestream import ChangeBatch
from mongo_outbox.errors import describe
from tests.support.outbox_storage import Storage
from tests.support.relay_fakes import CheckingBroker, GatedSource, KillSwitch

EXAMPLES = int(os.environ.get("RELAY_MODEL_EXAMPLES", "100"))
STEPS = int(os.environ.get("RELAY_MODEL_STEPS", "50"))
HOUR = 3600.0
BACKOFF = Backoff(initial=HOUR, maximum=HOUR)  # retries come due when time_passes says so
STEP_TIMEOUT = 20.0  # a step takes milliseconds; one that does not end is a hang or a hot loop
HOT_LOOP = 5  # a first try, a wake and a probe (on one-second timers), and room to spare
AGGREGATES = st.integers(0, 2)
# An event's type ("b" may have no route), and whether the broker rejects it or finds it invalid.
EVENTS = st.lists(
    st.tuples(st.sampled_from("ab"), st.sampled_from([None, None, None, "rejected", "invalid"])),
    min_size=1,
    max_size=4,
)
# "update": an update_with_events of operators, whose embedded entries go in unnumbered and are
# numbered by their position when a relay reads them: published unchanged means numbered right.
SAVES = ["commit", "commit", "update", "update", "abort", "refuse"]
# What a collection-mode entry gains after its insert, and what it was inserted with.
ENTRY_STATE = {"claim", "last_error", "waiting", "waits", "published_at", "expire_at"}
FRESH_ENTRY = {"status": "pending", "attempts": 0}
BATCH_SIZES = st.sampled_from([1, 2, 3, 100])
LIFECYCLE = ["start", "restart", "killed", "by hand", "lease runs out", "stalled settles"]
HAPPENINGS = ["up", "down", "no route for b", "no route for b", "heals", "requeue", "requeue"]
KINDS = ["polling", "changestream", "stream"]  # "stream": a ChangeStreamRelay that runs

T = TypeVar("T")
SEEN: Counter[str] = Counter()  # what the examples reached, printed at the end (pytest -s)


def seen(what: str) -> None:
    SEEN[what] += 1
    with contextlib.suppress(InvalidArgument):  # on the loop's thread, outside hypothesis's
        event(what)


# Rules draw indices, always, and have no preconditions: what there is to pick from may depend
# on the relays' one-second timers, and hypothesis must make the same draws when it replays a case.


def pick(data: st.DataObject, items: list[T], label: str) -> T | None:
    """One of ``items`` (``None`` if there is none)."""
    index = data.draw(st.integers(0, 255), label=label)
    chosen = items[index % len(items)] if items else None
    note(f"{label}: {chosen!r}")
    return chosen


def picks(data: st.DataObject, items: list[T], label: str, most: int = 4) -> list[T]:
    """Up to ``most`` of ``items``, maybe the same more than once."""
    indices = data.draw(st.lists(st.integers(0, 255), max_size=most), label=label)
    chosen = [items[i % len(items)] for i in indices] if items else []
    note(f"{label}: {chosen!r}")
    return chosen


@pytest.mark.model
@pytest.mark.parametrize("mode", ["collection", "embedded"])
@pytest.mark.timeout(600)  # the search takes well under a minute; shrinking a failure, minutes
async def test_random_interleavings_of_saves_failures_and_relays_keep_the_guarantees(
    client: Any, mode: str
) -> None:
    loop = asyncio.get_running_loop()
    tuning = settings(
        max_examples=EXAMPLES,
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        report_multiple_bugs=False,  # shrinking one failure already takes minutes
    )

    class Machine(RelayModel):
        def __init__(self) -> None:
            super().__init__(loop, client, mode)

    SEEN.clear()
    # Hypothesis drives the machine from a worker thread; each rule runs its coroutines on this
    # test's loop, where the session's client lives, and waits for them.
    await asyncio.to_thread(run_state_machine_as_test, Machine, settings=tuning)
    print(f"\n{mode}: {dict(sorted(SEEN.items()))}")


@dataclass
class Process:
    """A relay process: the relay object of its latest start (and its task, if it runs)."""

    kind: str
    batch_size: int
    number: int
    relay: Any = None
    task: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        return f"{self.kind}{self.number}(batch_size={self.batch_size})"


@dataclass
class DeadClaim:
    claim: Claim
    published: list[Event] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"DeadClaim({self.claim.token[:6]}, published={len(self.published)})"


class RelayModel(RuleBasedStateMachine):
    def __init__(self, loop: asyncio.AbstractEventLoop, client: Any, mode: str) -> None:
        super().__init__()
        self.loop = loop
        self.client = client
        self.db = client[f"m_{uuid.uuid4().hex[:12]}"]
        self.outbox = Outbox(self.db, mode=mode, collections=["orders"])  # type: ignore[arg-type]
        self.store = store_for(self.outbox)
        self.storage = Storage(self.outbox)
        self.broker = CheckingBroker(self.failure_for, self.check_publication)
        self.source = GatedSource()
        self.acting: str | None = None  # the claim of a dead relay publishing by hand
        # The world as the model knows it.
        self.committed: dict[str, Event] = {}
        self.by_sequence: dict[Any, list[str]] = defaultdict(list)  # ids per aggregate
        self.versions: Counter[Any] = Counter()
        self.doomed: set[str] = set()
        self.broker_state = "up"
        self.rejecting: set[str] = set()
        self.invalid: set[str] = set()
        self.first_published: set[str] = set()
        self.redeliverable: set[str] = set()
        self.processes: list[Process] = []
        self.stream: Process | None = None
        self.started = 0
        self.dead: set[str] = set()  # claim tokens of dead relays
        self.leases: dict[str, set[Any]] = {}  # what a dead relay's claim holds, until it ends
        self.stalled: list[DeadClaim] = []
        self.parked: dict[str, str | None] = {}  # id: last_error, as the store lists them
        self.failures: dict[str, Counter[str]] = defaultdict(Counter)  # settled, since requeue
        self.max_attempts = 2
        self.run(self.outbox.ensure_indexes())

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout=STEP_TIMEOUT)
        except TimeoutError:
            future.cancel()
            tries = Counter(event_id for event_id, _ in self.broker.attempts)
            raise AssertionError(
                f"a step did not end within {STEP_TIMEOUT:g} s: a hang or a hot loop? "
                f"{len(self.broker.attempts)} publish attempts, most {tries.most_common(1)}"
            ) from None

    # -- saves, faults ------------------------------------------------------------------------

    @rule(aggregate=AGGREGATES, kinds=EVENTS, how=st.sampled_from(SAVES))
    def save(self, aggregate: int, kinds: list[tuple[str, str | None]], how: str) -> None:
        """A save that commits, or that is aborted on purpose inside a transaction, or that
        ``expected_version`` refuses: the events of those two must never be published. Each
        event has a type, and may be bad from the start: rejected by the broker (an attempt each
        time) or invalid (parked at once), until it heals."""
        events = [
            Event(type=t, payload={"n": len(self.committed) + i}) for i, (t, _) in enumerate(kinds)
        ]
        orders = self.db.orders
        if how in ("commit", "update"):
            write = (
                self.outbox.save_with_events(None, orders, {"_id": aggregate}, events)
                if how == "commit"
                else self.outbox.update_with_events(
                    None, orders, {"_id": aggregate}, {"$inc": {"n": 1}}, events, upsert=True
                )
            )
            saved = self.run(write)
            first = len(self.by_sequence[aggregate]) + 1  # nothing uncommitted took a number
            assert [e.sequence for e in saved.events] == list(range(first, first + len(events)))
            self.versions[aggregate] += 1
            for stored, (_, fault) in zip(saved.events, kinds, strict=True):
                self.committed[stored.id] = stored
                self.by_sequence[aggregate].append(stored.id)
                if fault is not None:
                    (self.rejecting if fault == "rejected" else self.invalid).add(stored.id)
            return
        self.doomed |= {e.id for e in events}

        async def aborted() -> None:
            async with self.client.start_session() as session:
                with pytest.raises(RuntimeError, match="on purpose"):
                    async with await session.start_transaction():
                        await self.outbox.save_with_events(
                            session, orders, {"_id": aggregate}, events
                        )
                        raise RuntimeError("aborted on purpose")

        async def refused() -> None:
            stale = self.versions[aggregate] + 1  # never the stored version
            with pytest.raises(ConcurrencyError):
                await self.outbox.save_with_events(
                    None, orders, {"_id": aggregate}, events, expected_version=stale
                )

        self.run(aborted() if how == "abort" else refused())

    @rule(data=st.data(), what=st.sampled_from(HAPPENINGS))
    def something_happens(self, data: st.DataObject, what: str) -> None:
        """The broker goes up, down or loses its route for type ``b``; a bad event heals; an
        operator requeues parked events."""
        if what in ("up", "down", "no route for b"):
            self.broker_state = what
        elif what == "heals":
            chosen = pick(data, sorted(self.rejecting | self.invalid), "event")
            self.rejecting.discard(chosen)
            self.invalid.discard(chosen)
        else:
            self._requeue(data)

    def failure_for(self, event: Event) -> BaseException | None:
        if event.id in self.invalid:
            return InvalidEventError("the broker cannot carry it", event_id=event.id)
        if self.broker_state == "down":
            return BrokerUnavailableError("connection refused", event_id=event.id)
        if event.id in self.rejecting:
            return RuntimeError("rejected")
        if self.broker_state == "no route for b" and event.type == "b":
            return BrokerUnavailableError("no queue bound", event_id=event.id, destination="b")
        return None

    async def check_publication(self, event: Event) -> list[str]:
        if event.id in self.doomed:
            return [f"{event.id} was published, but its save was aborted or refused"]
        if event.id not in self.committed:
            return [f"{event.id} was published, but never committed"]
        wrong = []
        if event != self.committed[event.id]:
            wrong.append(f"{event.id} was published changed: {event!r}")
        key = self.storage.key(event)
        for token, held in self.leases.items():
            if key in held and token != self.acting:
                wrong.append(f"{event.id} was published while a dead relay's claim held it")
        parked = await self.storage.parked(event.aggregate_id)
        if event.id in parked:
            wrong.append(f"{event.id} was published while parked")
        if event.id not in self.first_published:
            earlier = self.by_sequence[event.aggregate_id][: (event.sequence or 0) - 1]
            overtaken = [e for e in earlier if e not in self.first_published and e not in parked]
            if overtaken:
                wrong.append(f"{event.id} (sequence {event.sequence}) overtook {overtaken}")
            self.first_published.add(event.id)
        return wrong

    # -- relays -------------------------------------------------------------------------------

    def _relay(self, process: Process) -> Any:
        tuning = RelaySettings(
            batch_size=process.batch_size, max_attempts=self.max_attempts, backoff=BACKOFF
        )
        if process.kind == "polling":
            return PollingRelay(self.outbox, self.broker, settings=tuning)
        return ChangeStreamRelay(
            self.outbox,
            self.broker,
            name=f"{process.kind}{process.number}",
            source=self.source,
            settings=tuning,
            max_wait=HOUR,  # it waits for the next batch until the model delivers one
            leader_lease=HOUR,
            sweep_interval=HOUR,
        )

    @initialize(kind=st.sampled_from(KINDS), batch_size=BATCH_SIZES, max_attempts=st.integers(1, 3))
    def first_relay(self, kind: str, batch_size: int, max_attempts: int) -> None:
        """The first relay process; ``max_attempts`` holds for every relay of the example."""
        self.max_attempts = max_attempts
        self._new_process(kind, batch_size)

    def _restart(self, process: Process) -> None:
        """A relay process restarts: a new relay object in its place."""
        if process.kind == "stream":
            self._relay_step(self._stop_stream())
            seen("the stream relay restarted")
        self._start(process)

    def _new_process(self, kind: str, batch_size: int) -> None:
        if kind == "stream" and self.stream is not None:
            kind = "polling"  # one follows the stream
        self.started += 1
        process = Process(kind, batch_size, self.started)
        self.processes.append(process)
        self._start(process)

    def _start(self, process: Process) -> None:
        process.relay = self._relay(process)
        if process.kind == "stream":
            self.stream = process

            async def follows() -> None:
                process.task = asyncio.ensure_future(process.relay.run())
                await self.source.wait_idle(process.task)

            self._relay_step(follows())  # it sweeps first, or resumes from its checkpoint

    async def _stop_stream(self) -> None:
        assert self.stream is not None and self.stream.task is not None
        if not self.stream.task.done():
            self.stream.relay.stop()
            self.source.batches.put_nowait(ChangeBatch([], None))
        await self.stream.task

    @rule(data=st.data(), drain=st.sampled_from([False, False, True]), later=st.booleans())
    def relay_publishes(self, data: st.DataObject, drain: bool, later: bool) -> None:
        """A relay's step, ``later``: once every backoff and recheck delay ran out. A polling
        relay publishes a batch or drains, a change-stream relay drains, and the one that runs
        is handed a change batch: inserts (collection mode) or updates of aggregates (embedded
        mode), new or replayed after a restart, for it to tell which still need publishing."""
        process = pick(data, self.processes, "process")
        assert process is not None
        if later:
            self.run(self.storage.make_due())
        if process.kind == "polling" and not drain:
            self._relay_step(process.relay.publish_batch())
        elif process.kind != "stream":
            self._relay_step(process.relay.drain())
        elif self.committed:
            unpublished = [e for e in self.committed if e not in self.first_published]
            ids = picks(data, unpublished + list(self.committed), "changes of")
            early = data.draw(st.booleans(), label="post-images looked up before a claim")
            task = process.task
            assert task is not None

            async def delivers() -> None:
                changes = await self._changes(ids, early)
                await self.source.deliver(ChangeBatch(changes, {"_data": uuid.uuid4().hex}), task)

            self._relay_step(delivers())
            seen("the stream delivered a batch")

    async def _changes(self, ids: list[str], early: bool) -> list[dict[str, Any]]:
        """Collection mode: the inserts of these events' entries, each as it was inserted.
        Embedded mode: updates of their aggregates, with the post-image as it is now, or
        (``early``) as it was looked up before a relay claimed the document."""
        ns = {"db": self.db.name}
        held = set().union(*self.leases.values())
        if self.outbox.mode == "collection":
            found = await self.db.outbox.find({"_id": {"$in": ids}}).to_list(None)
            if any(e["_id"] in held for e in found):
                seen("the stream delivered an entry that a dead relay holds")
            inserted = [
                {k: v for k, v in e.items() if k not in ENTRY_STATE} | FRESH_ENTRY for e in found
            ]
            return [
                {"operationType": "insert", "ns": {**ns, "coll": "outbox"}, "fullDocument": e}
                | {"documentKey": {"_id": e["_id"]}}
                for e in sorted(inserted, key=lambda e: ids.index(e["_id"]))
            ]
        aggregates = list(dict.fromkeys(self.committed[i].aggregate_id for i in ids))
        docs = await self.db.orders.find({"_id": {"$in": aggregates}}).to_list(None)
        if any(d["_id"] in held for d in docs):
            seen("the stream delivered a document that a dead relay holds")
        return [
            {"operationType": "update", "ns": {**ns, "coll": "orders"}}
            | {"fullDocument": {**d, self.outbox.claim_field: None} if early else d}
            | {"documentKey": {"_id": d["_id"]}, "updateDescription": {"updatedFields": {}}}
            for d in docs
        ]

    def _relay_step(
        self, publishing: Coroutine[Any, Any, Any], died: Callable[[], bool] = lambda: False
    ) -> None:
        """Run a relay's step and check what it did. A live relay settles every failure; one
        that ``died`` settled nothing: its claim and what it published come back after its
        lease."""
        before = dict(self.parked)
        held = self.run(self.storage.claims())
        confirmed = len(self.broker.events)
        self.broker.attempts.clear()
        self.run(publishing)
        self._observe_parked()
        tries = Counter(event_id for event_id, _ in self.broker.attempts)
        assert max(tries.values(), default=0) <= HOT_LOOP, f"hot loop: {tries.most_common(1)}"
        if died():
            seen("a relay died after a confirm")
            assert self.parked == before, "a relay that died before its settle parked something"
            left = self.run(self.storage.claims()) - held
            assert left, "a relay that died before its settle left no claim behind"
            self._died(*left)
            self.redeliverable |= {e.id for e in self.broker.events[confirmed:]}
            return
        assert set(before) <= set(self.parked), f"unparked: {set(before) - set(self.parked)}"
        last_error: dict[str, str] = {}
        for event_id, error in self.broker.attempts:
            if error is None:
                continue
            last_error[event_id] = describe(error)
            kind = type(error).__name__
            if isinstance(error, BrokerUnavailableError):
                kind = "no route" if error.destination else "outage"
            self.failures[event_id][kind] += 1
            parks = kind == "InvalidEventError" or (
                kind == "RuntimeError" and self.failures[event_id][kind] >= self.max_attempts
            )
            assert not parks or event_id in self.parked, f"{event_id} not parked after {kind}"
        for event_id in set(self.parked) - set(before):
            causes = self.failures[event_id]
            own = causes["RuntimeError"] + causes["no route"]
            assert causes["InvalidEventError"] or own >= self.max_attempts, (
                f"{event_id} was parked without a cause of its own: {dict(causes)}"
            )
            assert self.parked[event_id] == last_error[event_id], "parked with another error"
            if causes["InvalidEventError"]:
                seen("parked at its InvalidEventError")
            elif causes["RuntimeError"] >= self.max_attempts:
                seen("parked after its attempts")
            else:
                seen("parked for its missing destination")

    def _observe_parked(self) -> None:
        records = self.run(self.store.parked())
        self.parked = {r["_id"]: r.get("last_error") for r in records}
        for record in records:
            assert record["_id"] in self.committed, f"parked {record['_id']} was never committed"
            assert record["status"] == "parked" and record.get("last_error"), record

    # -- relays that die ----------------------------------------------------------------------

    @rule(
        data=st.data(),
        what=st.sampled_from(LIFECYCLE),
        kind=st.sampled_from(KINDS),
        size=BATCH_SIZES,
        confirms=st.integers(0, 3),
    )
    def relays_come_and_go(
        self, data: st.DataObject, what: str, kind: str, size: int, confirms: int
    ) -> None:
        """``start``: a new relay process of ``kind`` and batch ``size`` (up to three).
        ``restart``: one gets a new relay object. ``killed``: a PollingRelay of batch ``size`` is
        cancelled right after the broker's ``confirms``-th confirm, before it settles (if its
        round has fewer to publish, it settles as usual). ``by hand``: a relay claimed ``size``
        through the store, published ``confirms`` waves (a failure ends its aggregate's), and
        died. ``lease runs out``: a dead relay's. ``stalled settles``: one that died by hand was
        only paused: it wakes up and settles what it published, maybe after its lease ran out
        and others took its entries over."""
        process = pick(data, self.processes, "process")
        if what == "start" and len(self.processes) < 3:
            self._new_process(kind, size)
        elif what in ("start", "restart"):
            assert process is not None
            self._restart(process)
        elif what == "by hand":
            self._dies_by_hand(size, confirms)
        elif what == "lease runs out":
            token = pick(data, sorted(self.leases), "claim")
            if token is not None:
                del self.leases[token]
                if self.run(self.storage.make_due(token)):
                    seen("a dead relay's lease ran out")
        elif what == "stalled settles":
            self._stalled_settles(data)
        else:
            self._killed(size, max(confirms, 1))

    def _killed(self, batch_size: int, confirms: int) -> None:
        tuning = RelaySettings(
            batch_size=batch_size, max_attempts=self.max_attempts, backoff=BACKOFF, claim_lease=HOUR
        )
        switch = KillSwitch(self.broker, confirms)
        relay = PollingRelay(self.outbox, switch, settings=tuning)

        async def killed() -> None:
            switch.task = task = asyncio.ensure_future(relay.publish_batch())
            with contextlib.suppress(asyncio.CancelledError):
                await task

        self._relay_step(killed(), died=lambda: switch.fired)

    def _dies_by_hand(self, limit: int, waves: int) -> None:
        async def dies() -> DeadClaim:
            claim = await self.store.claim(limit, timedelta(seconds=HOUR))
            dead = DeadClaim(claim)
            queues = [list(group) for group in claim.groups]
            self.acting = claim.token
            try:
                for _ in range(waves):
                    survivors = []
                    for queue in queues:
                        with contextlib.suppress(Exception):
                            await self.broker.publish(queue[0])
                            dead.published.append(queue.pop(0))
                            if queue:
                                survivors.append(queue)
                    queues = survivors
            finally:
                self.acting = None
            return dead

        before = dict(self.parked)
        dead = self.run(dies())
        self._observe_parked()
        assert self.parked == before, "a claim parked something"
        self._died(dead.claim.token)
        self.stalled.append(dead)
        self.redeliverable |= {e.id for e in dead.published}

    def _died(self, *tokens: str) -> None:
        for token in tokens:
            self.dead.add(token)
            self.leases[token] = self.run(self.storage.held(token))

    def _stalled_settles(self, data: st.DataObject) -> None:
        dead = pick(data, self.stalled, "stalled")
        if dead is None:
            return
        self.stalled.remove(dead)
        self.leases.pop(dead.claim.token, None)  # from now on it holds nothing
        before = dict(self.parked)
        self.run(self.store.settle(dead.claim, dead.published, []))
        assert dead.claim.token not in self.run(self.storage.claims())
        self._observe_parked()
        gone = set(before) - set(self.parked)
        assert set(self.parked) <= set(before) and gone <= {e.id for e in dead.published}
        seen("a stalled relay settled")

    # -- operators ----------------------------------------------------------------------------

    def _requeue(self, data: st.DataObject) -> None:
        """Requeue some parked events, and maybe an id that is not parked (ignored), through
        a relay process or a relay object of the operator's own."""
        asked = picks(data, sorted(self.parked), "ids", most=2)
        asked += picks(data, list(self.committed), "and ids that may not be parked", most=1)
        by = pick(data, [None, *self.processes], "through")
        if not asked:
            return
        relay = by.relay if by else PollingRelay(self.outbox, self.broker)
        before = set(self.parked)
        latest: dict[Any, int] = defaultdict(int)
        for event_id in set(asked) & before:
            stored = self.committed[event_id]
            latest[stored.aggregate_id] = max(latest[stored.aggregate_id], stored.sequence or 0)
        expected = {
            e
            for e in before
            if e in asked
            or (self.committed[e].sequence or 0) <= latest[self.committed[e].aggregate_id]
        }
        requeued = self.run(relay.requeue(asked))
        self._observe_parked()
        unparked = before - set(self.parked)
        assert unparked == expected, f"asked {asked}: unparked {unparked}, not {expected}"
        assert set(self.parked) <= before and requeued == len(expected), requeued
        for event_id in expected:
            self.failures.pop(event_id, None)  # a fresh set of attempts
        if expected:
            seen("parked events were requeued")

    # -- after every step ---------------------------------------------------------------------

    @invariant()
    def publications_are_allowed(self) -> None:
        assert not self.broker.violations, self.broker.violations
        counts = Counter(e.id for e in self.broker.events)
        again = {event_id for event_id, n in counts.items() if n > 1}
        assert again <= self.redeliverable, f"published twice: {again - self.redeliverable}"

    @invariant()
    def only_dead_relays_hold_claims(self) -> None:
        held = self.run(self.storage.claims())
        assert held <= self.dead, f"claims left behind by live relays: {held - self.dead}"

    # -- the end ------------------------------------------------------------------------------

    def teardown(self) -> None:
        # Hypothesis calls this in a ``finally``: after a failed step, that failure is the one
        # to report, not what the end of a broken run would find.
        failing = sys.exc_info()[0] is not None
        try:
            if self.stream is not None and self.stream.task is not None:
                with contextlib.suppress(*((Exception,) if failing else ())):
                    self.run(self._stop_stream())
            if not failing:
                self.run(self._everything_comes_out())
                self.publications_are_allowed()
                duplicates = len(self.broker.events) - len(self.first_published)
                if duplicates:
                    seen("published again after a lease ran out")
        finally:
            self.run(self.client.drop_database(self.db.name))

    async def _everything_comes_out(self) -> None:
        self.broker_state = "up"
        self.rejecting.clear()
        self.invalid.clear()
        self.leases.clear()
        relay = PollingRelay(self.outbox, self.broker, settings=RelaySettings(backoff=BACKOFF))
        for _ in range(5):
            await self.storage.make_all_due()
            parked = [r["_id"] for r in await self.store.parked()]
            if parked:
                await relay.requeue(parked)
            await relay.drain()
            if not (await self.store.backlog()).pending and not await self.store.parked_count():
                break
        assert not self.broker.violations, self.broker.violations
        missing = set(self.committed) - self.first_published
        assert not missing, f"committed but never published: {missing}"
