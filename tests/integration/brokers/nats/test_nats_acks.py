"""NatsPublisher's own ack mux against the real NATS server: a stream's error reply surfaces at
once (nats-py's publish_async would leave it pending for ever, nats.py#985), duplicates count as
stored, a missing or unreadable ack fails only its own message, and closing fails what is in
flight at once."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.js.errors
import pytest
from nats.js.api import DiscardPolicy

from mongo_outbox import BrokerFullError, BrokerUnavailableError, PublishError
from mongo_outbox.brokers.nats import _jetstream
from mongo_outbox.publishers import NatsPublisher
from tests.support.messages import event, read_stream
from tests.support.servers import NATS_URL

# Each publisher here waits this long for an ack: an error that took it would fail the test.
PATIENT = 60.0
PROMPT = 10.0  # generous for a loaded machine, still far below PATIENT


async def test_a_full_streams_refusal_surfaces_at_once_beside_stored_messages(
    nats_client: Any, unique: str
) -> None:
    js = nats_client.jetstream()
    await js.add_stream(
        name=unique, subjects=[f"{unique}.>"], max_msgs=2, discard=DiscardPolicy.NEW
    )
    try:
        publisher = NatsPublisher(js, subject=f"{unique}.{{type}}", timeout=PATIENT)
        sent = [event(sequence=n) for n in range(1, 5)]
        results = await asyncio.wait_for(publisher.publish_many(sent), PROMPT)
        assert results[:2] == [None, None]
        for result, refused in zip(results[2:], sent[2:], strict=True):
            assert isinstance(result, BrokerFullError) and result.event_id == refused.id
            assert isinstance(result.__cause__, nats.js.errors.APIError)
            assert "maximum messages exceeded" in str(result)
        messages = await read_stream(nats_client, unique, 2)
        assert [m.headers["Nats-Msg-Id"] for m in messages] == [e.id for e in sent[:2]]
    finally:
        await js.delete_stream(unique)


async def test_no_stream_for_a_subject_surfaces_at_once_as_a_missing_destination(
    nats_client: Any, nats_stream: str, unique: str
) -> None:
    publisher = NatsPublisher(
        nats_client.jetstream(), subject=lambda e: e.headers["to"], timeout=PATIENT
    )
    stored = event(headers={"to": f"{nats_stream}.ok"})
    lost = event(headers={"to": f"{unique}x.nowhere"})
    results = await asyncio.wait_for(publisher.publish_many([lost, stored, lost]), PROMPT)
    assert results[1] is None
    for result in (results[0], results[2]):
        assert isinstance(result, BrokerUnavailableError)
        assert result.destination == f"{unique}x.nowhere"  # the 503 no-responders status
        assert isinstance(result.__cause__, nats.js.errors.NoStreamResponseError)
    with pytest.raises(BrokerUnavailableError):
        await asyncio.wait_for(publisher.publish(lost), PROMPT)


async def test_a_duplicate_in_one_chunk_and_across_chunks_counts_as_stored(
    nats_client: Any, nats_stream: str
) -> None:
    publisher = NatsPublisher(nats_client.jetstream(), subject=f"{nats_stream}.{{type}}")
    first, second = event(sequence=1), event(sequence=2)
    assert await publisher.publish_many([first, second, first, first]) == [None] * 4
    assert await publisher.publish_many([second, first]) == [None, None]
    messages = await read_stream(nats_client, nats_stream, 2)
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [first.id, second.id]
    # JetStream said duplicate: a plain publish of the same id shows it.
    ack = await nats_client.jetstream().publish(
        f"{nats_stream}.x", b"{}", headers={"Nats-Msg-Id": first.id}
    )
    assert ack.duplicate


async def test_a_missing_or_unreadable_ack_fails_only_its_own_message(
    nats_client: Any, nats_stream: str, unique: str
) -> None:
    # Core subscribers where no stream is: one never answers, one answers nonsense.
    async def nonsense(msg: Any) -> None:
        await msg.respond(b"not json")

    silent = await nats_client.subscribe(f"{unique}x.silent")
    garbled = await nats_client.subscribe(f"{unique}x.garbled", cb=nonsense)
    await nats_client.flush()
    try:
        publisher = NatsPublisher(
            nats_client.jetstream(), subject=lambda e: e.headers["to"], timeout=1.0
        )
        good = event(headers={"to": f"{nats_stream}.ok"})
        unanswered = event(headers={"to": f"{unique}x.silent"})
        unreadable = event(headers={"to": f"{unique}x.garbled"})
        results = await asyncio.wait_for(
            publisher.publish_many([unanswered, good, unreadable]), PROMPT
        )
        assert results[1] is None
        assert isinstance(results[0], BrokerUnavailableError)
        assert "no ack within 1s" in str(results[0]) and results[0].event_id == unanswered.id
        assert isinstance(results[2], nats.js.errors.APIError)
        assert "unreadable JetStream ack" in str(results[2])
        # The ack that never came is no longer awaited: the next chunk is not held up by it.
        assert await asyncio.wait_for(publisher.publish_many([good]), PROMPT) == [None]
    finally:
        await silent.unsubscribe()
        await garbled.unsubscribe()


async def test_aclose_fails_publishes_in_flight_at_once(nats_client: Any, unique: str) -> None:
    silent = await nats_client.subscribe(f"{unique}.silent")
    await nats_client.flush()
    publisher = await NatsPublisher.connect(NATS_URL, subject=f"{unique}.silent", timeout=PATIENT)
    try:
        in_flight = asyncio.create_task(publisher.publish_many([event(), event()]))
        # Both messages reached the server: their acks are what the publisher waits for.
        await asyncio.wait_for(silent.next_msg(timeout=PROMPT), PROMPT)
        await asyncio.wait_for(silent.next_msg(timeout=PROMPT), PROMPT)
        await publisher.aclose()
        results = await asyncio.wait_for(in_flight, PROMPT)
        assert all(isinstance(r, PublishError) and "closed" in str(r) for r in results)
    finally:
        await publisher.aclose()
        await silent.unsubscribe()


async def test_two_chunks_in_flight_at_once_each_get_exactly_their_own_outcomes(
    nats_client: Any, nats_stream: str, unique: str
) -> None:
    # As the relay drives a publisher: one chunk sent while the other awaits its acks, both
    # settled by the one ack subscription as the connection reads them.
    publisher = NatsPublisher(
        nats_client.jetstream(), subject=lambda e: e.headers["to"], timeout=PATIENT
    )
    first = [event(headers={"to": f"{nats_stream}.a"}) for _ in range(40)]
    lost = event(headers={"to": f"{unique}x.nowhere"})
    first.insert(17, lost)
    second = [event(headers={"to": f"{nats_stream}.b"}) for _ in range(40)]
    second.append(first[3])  # already stored by the other chunk, or about to be: a duplicate
    results = await asyncio.wait_for(
        asyncio.gather(publisher.publish_many(first), publisher.publish_many(second)), PROMPT
    )
    assert results[1] == [None] * len(second)
    refused = results[0].pop(17)
    assert results[0] == [None] * 40
    assert isinstance(refused, BrokerUnavailableError) and refused.event_id == lost.id
    assert refused.destination == f"{unique}x.nowhere"
    messages = await read_stream(nats_client, nats_stream, 80)
    stored = {e.id for e in first + second if e is not lost}
    assert {m.headers["Nats-Msg-Id"] for m in messages} == stored
    # Every ack was handled as it came: the subscription holds none back.
    mux = publisher._mux
    assert mux is not None and not mux.pending
    assert mux._subscription.pending_msgs == 0 and mux._subscription.pending_bytes == 0


async def test_two_publishers_on_one_connection_each_get_their_own_acks(
    nats_client: Any, nats_stream: str, unique: str
) -> None:
    # Each publisher's mux takes its plain acks straight from the connection's reader, and the
    # two publishers' acks differ (one stream takes 100 of 150, the other all): crossed acks
    # would show. The connection's other subscriptions (a reader of the stream) still get
    # theirs, and a closed publisher's mux takes none.
    js = nats_client.jetstream()
    full = f"{unique}full"
    await js.add_stream(name=full, subjects=[f"{full}.>"], max_msgs=100, discard=DiscardPolicy.NEW)
    try:
        one = NatsPublisher(js, subject=lambda e: e.headers["to"], timeout=PATIENT)
        two = NatsPublisher(js, subject=lambda e: e.headers["to"], timeout=PATIENT)
        firsts = [event(headers={"to": f"{full}.one"}) for _ in range(150)]
        seconds = [event(headers={"to": f"{nats_stream}.two"}) for _ in range(150)]
        lost = event(headers={"to": f"{unique}x.nowhere"})
        results = await asyncio.wait_for(
            asyncio.gather(one.publish_many([*firsts, lost]), two.publish_many(seconds)), PROMPT
        )
        assert results[0][:100] == [None] * 100 and results[1] == [None] * 150
        assert all(isinstance(r, BrokerFullError) for r in results[0][100:150])
        assert isinstance(results[0][-1], BrokerUnavailableError)
        routes = nats_client._mongo_outbox_ack_routes
        assert one._mux is not None and one._mux._subscription._id in routes
        await one.aclose()
        assert len(routes) == 1 and two._mux is not None and two._mux._subscription._id in routes
        more = [event(headers={"to": f"{nats_stream}.two"}) for _ in range(70)]
        assert await asyncio.wait_for(two.publish_many(more), PROMPT) == [None] * 70
        stored = await read_stream(nats_client, full, 100)
        assert [m.headers["Nats-Msg-Id"] for m in stored] == [e.id for e in firsts[:100]]
        messages = await read_stream(nats_client, nats_stream, 220)
        assert [m.headers["Nats-Msg-Id"] for m in messages] == [e.id for e in seconds + more]
        assert not one._mux.pending and not two._mux.pending
    finally:
        await js.delete_stream(full)


async def test_a_chunk_hands_its_first_messages_over_before_it_builds_the_rest(
    nats_client: Any, nats_stream: str
) -> None:
    # The server stores a long chunk's first messages while the rest are built: when the
    # 150th message is named, the connection's buffer no longer holds the first ones.
    buffered: list[int] = []

    def subject(e: Any) -> str:
        buffered.append(len(nats_client._pending))
        return f"{nats_stream}.x"

    publisher = NatsPublisher(nats_client.jetstream(), subject=subject, timeout=PATIENT)
    sent = [event() for _ in range(200)]
    assert await asyncio.wait_for(publisher.publish_many(sent), PROMPT) == [None] * 200
    assert max(buffered) < 100, buffered
    messages = await read_stream(nats_client, nats_stream, 200)
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [e.id for e in sent]


async def test_aclose_while_a_long_chunk_is_built_sends_none_of_the_rest(
    nats_client: Any, nats_stream: str
) -> None:
    # The chunk yields while it hands its first messages over; a publisher closed then sends
    # nothing more, and every message it did not confirm says the publisher is closed.
    closing: list[asyncio.Task[None]] = []

    def subject(e: Any) -> str:
        if not closing:
            closing.append(asyncio.get_running_loop().create_task(publisher.aclose()))
        return f"{nats_stream}.x"

    publisher = NatsPublisher(nats_client.jetstream(), subject=subject, timeout=PATIENT)
    sent = [event() for _ in range(200)]
    results = await asyncio.wait_for(publisher.publish_many(sent), PROMPT)
    await closing[0]
    refused = [i for i, r in enumerate(results) if r is not None]
    assert all(isinstance(results[i], PublishError) for i in refused)
    assert all("closed" in str(results[i]) for i in refused)
    assert refused[-1] == 199 and len(refused) >= 200 - 64
    # Nothing after the first hand-over reached the stream; what did reach it is at least what
    # was confirmed (the rest is published again by the relay, and deduplicated).
    await asyncio.sleep(0.5)
    info = await nats_client.jetstream().stream_info(nats_stream)
    assert 200 - len(refused) <= info.state.messages <= 64


async def test_aclose_during_a_send_that_yields_fails_the_chunk_at_once(
    nats_client: Any, nats_stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While nats-py's own publish takes the messages (reconnecting, or another nats-py), each
    # send may yield: a publisher closed then sends nothing more, and what it sent after the
    # close, whose acks nobody reads any more, fails at once rather than at its timeout.
    monkeypatch.setattr(_jetstream, "_RAW", False)
    publish = _jetstream.AckMux.send

    async def yielding(mux: Any, *args: Any) -> None:
        await publish(mux, *args)
        await asyncio.sleep(0)

    monkeypatch.setattr(_jetstream.AckMux, "send", yielding)
    closing: list[asyncio.Task[None]] = []

    def subject(e: Any) -> str:
        if len(closing) < 1:
            closing.append(asyncio.get_running_loop().create_task(publisher.aclose()))
        return f"{nats_stream}.x"

    publisher = NatsPublisher(nats_client.jetstream(), subject=subject, timeout=PATIENT)
    results = await asyncio.wait_for(publisher.publish_many([event() for _ in range(50)]), PROMPT)
    await closing[0]
    assert all(isinstance(r, PublishError) and "closed" in str(r) for r in results)
    await asyncio.sleep(0.5)
    info = await nats_client.jetstream().stream_info(nats_stream)
    assert info.state.messages <= 1
