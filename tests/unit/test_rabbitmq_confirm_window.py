"""Model-based test of the RabbitMQ publisher's confirm window (``_confirms.ConfirmWindow``).

A hypothesis state machine writes waves of messages, and a FAKE broker answers them in any
order RabbitMQ may: each message is routed, returned (``mandatory``, no queue bound) or nacked
(a queue at its limit with ``reject-publish``), or returned and nacked, as the broker decides;
its ``basic.return`` comes before its confirm (RabbitMQ sends it first), with any other frame
between; a single ack or nack may settle any unconfirmed tag, in any order (RabbitMQ flushes
acks before nacks); a ``multiple`` ack or nack with tag t settles every tag up to t not
confirmed yet, and is only sent when each of them has that answer. Messages are drawn from a
few routing keys and bodies, so that copies of one message (an event published again while its
first copy is in flight) are in flight together, some routed and some returned.

Checked after every step:

- a message's outcome is settled exactly when the broker confirmed its tag, and a nacked one
  is reported nacked, a confirmed one never nacked;
- among the confirmed copies of one message, no more are reported acked than were routed: a
  returned copy may take the report of a routed twin (identical, so the message is in a queue
  either way, and the other copy is retried: a duplicate, never a loss), but when no copy was
  routed, none is reported acked; no copy is reported returned unless a copy's return came;
- a wave is done exactly when every one of its tags is confirmed.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from types import SimpleNamespace
from typing import Any

import aiormq
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pamqp import commands as spec

from mongo_outbox.brokers.rabbitmq._confirms import (
    PENDING,
    UNCONFIRMED_BYTES,
    ConfirmWindow,
    Wave,
    unblocked,
)

KEYS = ("kept", "lost")
BODIES = (b'{"id":"a"}', b'{"id":"b"}', b'{"id":"c"}')
# "returned, nacked": RabbitMQ's documentation says a return comes before a nack too (never
# seen from a server: it nacks only what a queue refused, and returns only what none took).
FATES = ("routed", "returned", "nacked", "returned, nacked")


class FakeChannel:
    """FAKE aiormq channel: the window only creates its futures and reads its number."""

    number = 1
    is_closed = False
    closing_begun = False
    window: Any = None

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def create_future(self) -> asyncio.Future[Any]:
        return self.loop.create_future()


class FakeConnection:
    """FAKE aiormq connection: its write queue takes the waves, and nothing reads it."""

    is_closed = False
    connection_tune = SimpleNamespace(frame_max=131_072)

    def __init__(self) -> None:
        self.server_properties = {"version": b"4.1.0"}
        self.write_queue: asyncio.Queue[Any] = asyncio.Queue()


def returned_message(key: str, body: bytes) -> Any:
    """FAKE ``DeliveredMessage`` of a ``basic.return``: what the window reads of one."""
    return SimpleNamespace(
        delivery=spec.Basic.Return(reply_code=312, reply_text="NO_ROUTE", routing_key=key),
        body=body,
        header=SimpleNamespace(properties=spec.Basic.Properties(message_id=body.decode())),
    )


class WindowModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.window = ConfirmWindow(FakeChannel(self.loop), FakeConnection())  # type: ignore[arg-type]
        # The broker's side: each tag's message, its fate, what was answered for it.
        self.message: dict[int, tuple[str, bytes]] = {}
        self.fate: dict[int, str] = {}
        self.return_sent: set[int] = set()
        self.confirmed: set[int] = set()
        self.waves: list[tuple[Wave, list[int]]] = []

    def teardown(self) -> None:
        self.loop.close()

    def unconfirmed(self) -> list[int]:
        return sorted(set(self.fate) - self.confirmed)

    def answer(self, tag: int) -> str | None:
        """The confirm the broker may send for ``tag`` now: "ack", "nack", or None (its return
        must go first)."""
        fate = self.fate[tag]
        if fate.startswith("returned") and tag not in self.return_sent:
            return None
        return "nack" if fate.endswith("nacked") else "ack"

    @rule(
        messages=st.lists(
            st.tuples(st.sampled_from(KEYS), st.sampled_from(BODIES), st.sampled_from(FATES)),
            min_size=1,
            max_size=6,
        )
    )
    def send_a_wave(self, messages: list[tuple[str, bytes, str]]) -> None:
        keys = [(key, body) for key, body, _ in messages]
        frames = [b"frame"] * len(keys)
        wave = self.loop.run_until_complete(self.window.send(frames, keys))
        tags = list(range(wave.first, wave.first + len(keys)))
        assert not set(tags) & set(self.fate), "a tag was given twice"
        for tag, (key, body, fate) in zip(tags, messages, strict=True):
            self.message[tag] = (key, body)
            self.fate[tag] = fate
        self.waves.append((wave, tags))

    @precondition(lambda self: any(self.fate[t].startswith("returned") for t in self.unconfirmed()))
    @rule(data=st.data())
    def broker_returns_one(self, data: st.DataObject) -> None:
        due = [
            t
            for t in self.unconfirmed()
            if self.fate[t].startswith("returned") and t not in self.return_sent
        ]
        if not due:
            return
        tag = data.draw(st.sampled_from(due))
        self.return_sent.add(tag)
        self.window.returned(returned_message(*self.message[tag]))

    @precondition(lambda self: self.unconfirmed())
    @rule(data=st.data())
    def broker_confirms_one(self, data: st.DataObject) -> None:
        ready = [t for t in self.unconfirmed() if self.answer(t) is not None]
        if not ready:
            return
        tag = data.draw(st.sampled_from(ready))
        frame = spec.Basic.Ack if self.answer(tag) == "ack" else spec.Basic.Nack
        self.confirmed.add(tag)
        self.window.confirmed(frame(delivery_tag=tag, multiple=False))

    @precondition(lambda self: self.unconfirmed())
    @rule(data=st.data())
    def broker_confirms_many(self, data: st.DataObject) -> None:
        # A multiple frame with tag t covers every unconfirmed tag up to t: RabbitMQ sends one
        # only when each of them has the same answer.
        pending = self.unconfirmed()
        covering = []
        for index, tag in enumerate(pending):
            answers = {self.answer(t) for t in pending[: index + 1]}
            if len(answers) == 1 and None not in answers:
                covering.append(tag)
        if not covering:
            return
        tag = data.draw(st.sampled_from(covering))
        frame = spec.Basic.Ack if self.answer(tag) == "ack" else spec.Basic.Nack
        self.confirmed |= {t for t in pending if t <= tag}
        self.window.confirmed(frame(delivery_tag=tag, multiple=True))

    @invariant()
    def each_outcome_is_its_own_tags(self) -> None:
        for wave, tags in self.waves:
            for position, tag in enumerate(tags):
                outcome = wave.outcome(position)
                if tag not in self.confirmed:
                    assert outcome is PENDING, f"tag {tag} settled by a frame not covering it"
                elif self.fate[tag].endswith("nacked"):
                    assert isinstance(outcome, spec.Basic.Nack), f"nacked tag {tag}: {outcome}"
                else:
                    assert outcome is not PENDING and not isinstance(outcome, spec.Basic.Nack), (
                        f"confirmed tag {tag}: {outcome}"
                    )

    @invariant()
    def no_copy_is_reported_acked_beyond_those_routed(self) -> None:
        routed: Counter[tuple[str, bytes]] = Counter()
        acked: Counter[tuple[str, bytes]] = Counter()
        reported_returned: Counter[tuple[str, bytes]] = Counter()
        for wave, tags in self.waves:
            for position, tag in enumerate(tags):
                if tag not in self.confirmed or self.fate[tag].endswith("nacked"):
                    continue
                message = self.message[tag]
                routed[message] += self.fate[tag] == "routed"
                outcome = wave.outcome(position)
                if outcome is None:
                    acked[message] += 1
                else:
                    assert (outcome.delivery.routing_key, outcome.body) == message
                    reported_returned[message] += 1
        returns = Counter(self.message[t] for t in self.return_sent)
        for message, count in acked.items():
            assert count <= routed[message], f"{message}: {count} acked, {routed[message]} routed"
        for message, count in reported_returned.items():
            assert count <= returns[message], f"{message}: {count} returned, {returns[message]}"

    @invariant()
    def a_wave_is_done_once_all_its_tags_are_confirmed(self) -> None:
        for wave, tags in self.waves:
            assert wave.done.done() == self.confirmed.issuperset(tags), tags


# 500 schedules of 40 steps: 1,000 took 18 s on a quiet machine and over pytest's 120 s on a
# busy one (it is CPU alone). The window is the same code on every Python: `make test-oldest`
# searches a quarter as many.
EXAMPLES = int(os.environ.get("CONFIRM_WINDOW_EXAMPLES", "500"))


@pytest.mark.model
def test_random_schedules_of_acks_nacks_and_returns_settle_each_tag_as_the_broker_did() -> None:
    tuning = settings(
        max_examples=EXAMPLES,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    run_state_machine_as_test(WindowModel, settings=tuning)


async def test_the_window_reads_connection_blocked_where_aiormq_keeps_it() -> None:
    # aiormq keeps it private: a rename would leave the window writing into a blocked broker.
    event = unblocked(aiormq.Connection("amqp://guest:guest@127.0.0.1:9/"))
    assert isinstance(event, asyncio.Event)
    connection = FakeConnection()
    connection._Connection__connection_unblocked = event  # type: ignore[attr-defined]
    window = ConfirmWindow(FakeChannel(asyncio.get_running_loop()), connection)  # type: ignore[arg-type]
    event.clear()
    assert window.blocked
    assert window.stalled(0) == "blocked by the broker (connection.blocked: a memory or disk alarm)"
    event.set()
    assert not window.blocked and window.stalled(UNCONFIRMED_BYTES) is None


async def test_a_return_that_matches_no_message_sent_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # RabbitMQ returns a message before its confirm, as published: one left over once every
    # message is confirmed means that rule broke, and its message may be reported published.
    window = ConfirmWindow(FakeChannel(asyncio.get_running_loop()), FakeConnection())  # type: ignore[arg-type]
    wave = await window.send([b"frame"], [("kept", b"a")])
    window.returned(returned_message("kept", b"not what was sent"))
    window.confirmed(spec.Basic.Ack(delivery_tag=wave.first, multiple=False))
    assert wave.outcome(0) is None
    assert "RabbitMQ returned 1 messages this publisher cannot match" in caplog.text


async def test_a_wave_queued_behind_its_channels_close_writes_nothing() -> None:
    # The connection's writer is behind (its queue full) when the broker closes the channel:
    # the wave goes into the queue after the channel's Close-Ok, and must write nothing, or
    # RabbitMQ closes the whole connection (a frame on a channel it no longer has).
    connection = FakeConnection()
    connection.write_queue = asyncio.Queue(maxsize=1)
    connection.write_queue.put_nowait("what the writer has yet to write")
    channel = FakeChannel(asyncio.get_running_loop())
    window = ConfirmWindow(channel, connection)  # type: ignore[arg-type]
    sending = asyncio.create_task(window.send([b"frame"], [("kept", b"a")]))
    await asyncio.sleep(0)
    channel.closing_begun = True  # as ``_ConfirmChannel`` does on the broker's Channel.Close
    connection.write_queue.get_nowait()  # the writer goes on
    with pytest.raises(aiormq.exceptions.ChannelInvalidStateError):
        await sending
    assert connection.write_queue.get_nowait().payload == b""
