"""The native Redis Streams path against the real Redis: RedisStreamsPublisher fed by the relay,
consume_redis settling through the inbox, and what happens to duplicates, retries, poison and
entries nobody can handle. Every key a test creates starts with its ``unique`` name."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from mongo_outbox import (
    Backoff,
    BrokerUnavailableError,
    ConfigurationError,
    Event,
    Inbox,
    InvalidEventError,
    PoisonMessage,
    inbox_guard,
)
from mongo_outbox.brokers._publishing import message_headers
from mongo_outbox.brokers.redis import _entries
from mongo_outbox.brokers.redis.publisher import entry_of
from mongo_outbox.consumers import consume_redis
from mongo_outbox.publishers import RedisStreamsPublisher
from tests.support.billing import (
    concurrency,
    guarded_billing,
    relay_twice,
    save_orders,
    wait_for_invoices,
)
from tests.support.servers import REDIS_URL
from tests.support.waiting import until


@pytest.fixture
async def redis(unique: str) -> AsyncIterator[Redis]:
    """A client of the real Redis; every key starting with ``unique`` is deleted afterwards."""
    client = Redis.from_url(REDIS_URL)
    yield client
    keys = [key async for key in client.scan_iter(match=f"{unique}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@contextlib.asynccontextmanager
async def consuming(redis: Redis, stream: str, guarded: Any, **options: Any) -> AsyncIterator[Any]:
    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_redis(redis, stream, "billing", guarded, stop=stop, **options)
    )
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def pending(redis: Redis, stream: str, group: str = "billing") -> int:
    return int((await redis.xpending(stream, group))["pending"])


async def test_relay_publishes_to_redis_and_consume_redis_handles_each_effect_once(
    db: Any, mongo: Any, redis: Redis, unique: str
) -> None:
    saved = await save_orders(db, 12)
    publisher = await RedisStreamsPublisher.connect(
        REDIS_URL, stream=f"{unique}:{{aggregate_type}}"
    )
    await relay_twice(db, publisher)  # every event twice: Redis keeps both copies
    stream = f"{unique}:orders"
    assert await redis.xlen(stream) == 2 * len(saved)
    # Entries nobody can handle: no event id, and a body that is not an Event.
    await redis.xadd(stream, {"body": b"{}"})
    await redis.xadd(stream, {"event-id": b"m-1", "body": b"not json"})
    rejected: list[str] = []

    async def on_rejected(body: bytes, reason: str) -> None:
        rejected.append(reason)

    flaky = {saved[0].id, saved[5].id}
    guarded = guarded_billing(db, flaky=flaky)
    async with consuming(redis, stream, guarded, rejected=on_rejected, batch=concurrency(mongo)):
        invoices = await wait_for_invoices(db, len(saved))
        await until(lambda: redis.xlen(f"{stream}:dead"), timeout=15)
        await until(lambda: no_pending(redis, stream), timeout=15)
    assert invoices == {e.id: 1 for e in saved}
    assert len(rejected) == 2
    dead = await redis.xrange(f"{stream}:dead")
    reasons = sorted(fields[b"dead-letter-reason"].decode() for _, fields in dead)
    assert len(reasons) == 2
    assert "no id to deduplicate on" in reasons[1] and "m-1 is not an Event" in reasons[0]


async def no_pending(redis: Redis, stream: str) -> bool:
    return await pending(redis, stream) == 0


async def test_an_entry_carries_the_event_id_type_aggregate_headers_and_body(
    redis: Redis, unique: str
) -> None:
    event = Event(
        type="order.placed",
        aggregate_type="orders",
        aggregate_id="o-1",
        sequence=3,
        headers={"tenant": "acme"},
        payload={"total": 5},
    )
    publisher = RedisStreamsPublisher(redis, stream=f"{unique}:{{aggregate_type}}:{{type}}")
    await publisher.publish(event)
    ((_, fields),) = await redis.xrange(f"{unique}:orders:order.placed")
    text = {key.decode(): value.decode() for key, value in fields.items()}
    assert text == entry_of(event)
    assert text["event-id"] == event.id and text["event-type"] == "order.placed"
    assert text["aggregate-type"] == "orders" and text["aggregate-id"] == "o-1"
    assert '"tenant":"acme"' in text["headers"] and '"sequence":"3"' in text["headers"]
    assert Event.from_json(fields[b"body"]) == event


async def test_publish_many_sends_one_pipeline_and_answers_for_each_event(
    redis: Redis, unique: str
) -> None:
    await redis.set(f"{unique}:taken", "a string, not a stream")
    publisher = RedisStreamsPublisher(redis, stream=f"{unique}:{{aggregate_type}}")
    events = [
        Event(type="a", aggregate_type="fine"),
        Event(type="b"),  # no aggregate_type: the template cannot be rendered
        Event(type="c", aggregate_type="taken"),
        Event(type="d", aggregate_type="fine"),
    ]
    results = await publisher.publish_many(events)
    assert results[0] is None and results[3] is None
    assert isinstance(results[1], InvalidEventError)
    # Another type under the stream's key: the destination is wrong, not the broker down.
    assert isinstance(results[2], BrokerUnavailableError)
    assert results[2].destination == f"{unique}:taken"
    ids = [fields[b"event-id"].decode() for _, fields in await redis.xrange(f"{unique}:fine")]
    assert ids == [events[0].id, events[3].id]


async def test_maxlen_trims_approximately_and_none_never_trims(redis: Redis, unique: str) -> None:
    trimmed = RedisStreamsPublisher(redis, stream=f"{unique}:trimmed", maxlen=50)
    kept = RedisStreamsPublisher(redis, stream=f"{unique}:kept", maxlen=None)
    events = [Event(type="e") for _ in range(1000)]
    for publisher in (trimmed, kept):
        assert await publisher.publish_many(events) == [None] * len(events)
    assert 50 <= await redis.xlen(f"{unique}:trimmed") < 1000
    assert await redis.xlen(f"{unique}:kept") == 1000


async def test_a_pending_entry_trimmed_away_is_logged_as_lost_not_dropped_silently(
    db: Any, redis: Redis, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    stream = f"{unique}:orders"
    await redis.xgroup_create(stream, "billing", id="0", mkstream=True)
    publisher = RedisStreamsPublisher(redis, stream=stream, maxlen=None)
    first = Event(type="e", aggregate_type="orders")
    await publisher.publish(first)
    # A consumer read it and died; then trimming removed it before anyone acknowledged it.
    await redis.xreadgroup("billing", "dead-consumer", {stream: ">"})
    await redis.xadd(
        stream, entry_of(Event(type="e", aggregate_type="orders")), maxlen=0, approximate=False
    )
    guarded = guarded_billing(db)
    with caplog.at_level(logging.ERROR, logger="mongo_outbox.brokers.redis.consumer"):
        async with consuming(redis, stream, guarded, claim_idle=0.1):
            await until(lambda: no_pending(redis, stream), timeout=15)
    assert any("lost to this group" in r.getMessage() for r in caplog.records)


async def test_a_stream_trimmed_past_what_the_group_read_is_logged(
    db: Any, mongo: Any, redis: Redis, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    stream = f"{unique}:orders"
    await redis.xgroup_create(stream, "billing", id="0", mkstream=True)
    # Published faster than the group reads, into a stream that keeps only ten entries.
    for _ in range(30):
        await redis.xadd(stream, entry_of(Event(type="e")), maxlen=10, approximate=False)
    with caplog.at_level(logging.ERROR, logger="mongo_outbox.brokers.redis.consumer"):
        async with consuming(redis, stream, guarded_billing(db), batch=concurrency(mongo)):
            await until(lambda: no_pending_and_read(redis, stream), timeout=15)
    assert await db.invoices.count_documents({}) == 10  # what was left of the thirty
    assert any("entries it never read are likely lost" in r.getMessage() for r in caplog.records)


async def test_a_retry_is_left_pending_and_reclaimed_after_its_delay_not_after_claim_idle(
    db: Any, redis: Redis, unique: str
) -> None:
    stream = f"{unique}:orders"
    runs: list[float] = []

    @inbox_guard(Inbox(db, consumer="billing"), backoff=Backoff(initial=0.3, maximum=0.3))
    async def flaky(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(time.monotonic())
        if attempt == 1:
            raise ConnectionError("ledger busy")

    publisher = RedisStreamsPublisher(redis, stream=stream)
    await publisher.publish(Event(type="e", aggregate_type="orders"))
    async with consuming(redis, stream, flaky, claim_idle=60) as task:
        await until(lambda: len(runs) == 1)
        # Not held in the process while it waits: pending in Redis, nothing in flight here.
        assert await pending(redis, stream) == 1 and not task.done()
        await until(lambda: len(runs) == 2, timeout=30)
        await until(lambda: no_pending(redis, stream))
    # The backoff's 0.3 s, far from claim_idle's 60 s.
    assert 0.25 <= runs[1] - runs[0] < 30


class SettleRace:
    """A real client whose first ``command`` sent while the first attempt runs is held back
    until the retry's settle (``XCLAIM ... IDLE``) has been answered, or for ``hold`` seconds
    (``None``: until cancelled): as if it waited for a connection of the pool while the settle
    went out on another (or its connection was silently gone)."""

    def __init__(self, client: Redis, command: str, hold: float | None = 1.0) -> None:
        self.client = client
        self.running = asyncio.Event()  # the first attempt runs
        self.reached = asyncio.Event()  # the held-back command was sent
        self.settled = asyncio.Event()
        settle, held = client.xclaim, getattr(client, command)

        async def xclaim(*args: Any, **kwargs: Any) -> Any:
            answer = await settle(*args, **kwargs)
            if kwargs.get("idle") is not None:
                self.settled.set()
            return answer

        async def late(*args: Any, **kwargs: Any) -> Any:
            # Only a keep-alive's XCLAIM, or any XAUTOCLAIM, is held back; never a settle.
            if not self.reached.is_set() and self.running.is_set() and "idle" not in kwargs:
                self.reached.set()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.settled.wait(), hold)
                return await held(*args, **kwargs)
            return await (xclaim if command == "xclaim" else held)(*args, **kwargs)

        client.xclaim = xclaim  # type: ignore[method-assign]
        setattr(client, command, late)

    def handler(self, db: Any, runs: list[float]) -> Any:
        @inbox_guard(Inbox(db, consumer="billing"), backoff=Backoff(initial=0.001, maximum=0.001))
        async def handle(event: Event, session: Any, *, attempt: int) -> None:
            if attempt == 1:
                self.running.set()
                await self.reached.wait()
                runs.append(time.monotonic())
                raise ConnectionError("ledger busy")
            runs.append(time.monotonic())

        return handle

    async def retried(self, db: Any, stream: str) -> float:
        """Seconds from the first attempt's failure to the second attempt."""
        runs: list[float] = []
        try:
            await RedisStreamsPublisher(self.client, stream=stream).publish(
                Event(type="e", aggregate_type="o")
            )
            # A keep-alive every 2 s: the first attempt waits for one when it is held back.
            async with consuming(self.client, stream, self.handler(db, runs), claim_idle=6):
                await until(lambda: len(runs) == 2, timeout=15)
                await until(lambda: no_pending(self.client, stream))
        finally:
            await self.client.aclose()
        return runs[1] - runs[0]


# In the three tests below, the second attempt comes within about a second (the held-back
# command's wait, then a read); before, after claim_idle's 6 s, or never.


async def test_a_retry_settled_while_a_reclaim_is_on_its_way_is_reclaimed_not_dropped(
    db: Any, redis: Redis, unique: str
) -> None:
    # The reclaim went out while the first attempt ran and reached Redis after the retry made
    # the entry due: it claimed the entry and dropped it as still in the process, so the entry
    # waited a whole claim_idle untouched instead of the retry's delay.
    race = SettleRace(Redis.from_url(REDIS_URL), "xautoclaim")
    assert await race.retried(db, f"{unique}:orders") < 4


async def test_a_keep_alive_on_its_way_does_not_undo_a_retry_s_delay(
    db: Any, redis: Redis, unique: str
) -> None:
    # The keep-alive went out while the first attempt ran and reached Redis after the retry's
    # settle: it reset the entry's idle time, so the retry waited claim_idle, not its delay.
    race = SettleRace(Redis.from_url(REDIS_URL), "xclaim")
    assert await race.retried(db, f"{unique}:orders") < 4


async def test_a_keep_alive_redis_never_answers_holds_no_settle_up(
    db: Any, redis: Redis, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The settles wait for the keep-alive's turn: one never answered would hold them for ever.
    monkeypatch.setattr(_entries, "ANSWER_WAIT", 0.5)
    race = SettleRace(Redis.from_url(REDIS_URL), "xclaim", hold=None)
    assert await race.retried(db, f"{unique}:orders") < 4


@pytest.mark.parametrize(
    ("setup", "options", "said"),
    [
        ("stream", {}, "holds a string, not a stream"),
        ("dead", {}, "holds a string, not a stream"),
        (None, {"start_id": "banana"}, "Redis refused group 'billing' of stream"),
        (None, {"max_deliveries": 0}, "max_deliveries must be >= 1"),
        (None, {"claim_idle": 1e20}, "claim_idle is too long"),
    ],
)
async def test_what_redis_would_refuse_stops_the_consumer_before_it_reads(
    db: Any, redis: Redis, unique: str, setup: str | None, options: dict[str, Any], said: str
) -> None:
    # Each was a raw redis error at the first command that met it, or (max_deliveries=0) taken
    # as unlimited; a dead-letter key of another type made every dead letter an XACK without
    # its copy.
    stream = f"{unique}:orders"
    if setup is not None:
        await redis.set(stream if setup == "stream" else f"{stream}:dead", "a string")
    with pytest.raises(ConfigurationError, match=said):
        await asyncio.wait_for(
            consume_redis(redis, stream, "billing", guarded_billing(db), **options), 10
        )


async def test_a_dead_letter_that_cannot_be_written_leaves_the_entry_pending(
    db: Any, redis: Redis, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The dead-letter key became a string after the consumer started: the XADD fails, and the
    # XACK that ran after it in one MULTI acknowledged an entry with no copy anywhere.
    stream = f"{unique}:orders"
    rejected: list[str] = []

    async def on_rejected(body: bytes, reason: str) -> None:
        rejected.append(reason)

    async with consuming(redis, stream, guarded_billing(db), rejected=on_rejected, claim_idle=1):
        await until(lambda: redis.exists(stream))  # started: the key was checked
        await redis.set(f"{stream}:dead", "a string")
        await redis.xadd(stream, {"body": b"{}"})  # no event id: to the dead letter
        await until(lambda: any("could not settle" in r.getMessage() for r in caplog.records))
        assert rejected and await pending(redis, stream) == 1  # not acknowledged
        await redis.delete(f"{stream}:dead")  # fixed: the next delivery moves it
        await until(lambda: no_pending(redis, stream), timeout=15)
        [(_, fields)] = await redis.xrange(f"{stream}:dead")
        assert b"no id to deduplicate on" in fields[b"dead-letter-reason"]


async def test_a_short_socket_timeout_reads_without_a_timeout_each_second(
    db: Any, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A read blocking 0.5 s under a 0.2 s socket timeout failed each time: a warning a second
    # on an idle stream. Under such a timeout the reads do not block.
    client = Redis.from_url(REDIS_URL, socket_timeout=0.2)
    stream = f"{unique}:orders"
    try:
        with caplog.at_level(logging.WARNING, logger="mongo_outbox.brokers.redis.consumer"):
            async with consuming(client, stream, guarded_billing(db)):
                await asyncio.sleep(2)
                await RedisStreamsPublisher(client, stream=stream).publish(
                    Event(type="e", aggregate_type="orders")
                )
                await until(lambda: no_pending_and_read(client, stream))
        assert not [r for r in caplog.records if "trying again" in r.getMessage()]
    finally:
        await client.delete(stream, f"{stream}:dead")
        await client.aclose()


async def test_poison_goes_to_the_dead_letter_stream_and_the_inbox_s_failed(
    db: Any, redis: Redis, unique: str
) -> None:
    stream = f"{unique}:orders"
    inbox = Inbox(db, consumer="billing")

    @inbox_guard(inbox, max_attempts=2, backoff=Backoff(initial=0.05, maximum=0.05))
    async def handler(event: Event, session: Any) -> None:
        if event.type == "poison":
            raise PoisonMessage("cannot bill this")
        if event.type == "always-fails":
            raise ValueError("still broken")

    publisher = RedisStreamsPublisher(redis, stream=stream)
    events = [Event(type=t, aggregate_type="orders") for t in ("poison", "always-fails", "ok")]
    assert await publisher.publish_many(events) == [None, None, None]
    async with consuming(redis, stream, handler, claim_idle=5):
        await until(lambda: dead_count(redis, f"{stream}:dead", 2), timeout=30)
        await until(lambda: no_pending(redis, stream), timeout=15)
    dead = {
        fields[b"event-id"].decode(): fields for _, fields in await redis.xrange(f"{stream}:dead")
    }
    assert set(dead) == {events[0].id, events[1].id}
    assert b"cannot bill this" in dead[events[0].id][b"dead-letter-reason"]
    assert Event.from_json(dead[events[1].id][b"body"]) == events[1]
    failed = {record["message_id"] for record in await inbox.failed()}
    assert failed == {events[0].id, events[1].id}


async def dead_count(redis: Redis, stream: str, wanted: int) -> bool:
    return await redis.xlen(stream) >= wanted


async def test_max_deliveries_makes_a_delivery_the_last_and_dead_letters_it(
    db: Any, redis: Redis, unique: str
) -> None:
    stream = f"{unique}:orders"
    inbox = Inbox(db, consumer="billing")

    @inbox_guard(inbox, max_attempts=100, backoff=Backoff(initial=0.05, maximum=0.05))
    async def handler(event: Event, session: Any) -> None:
        raise ValueError("always")

    publisher = RedisStreamsPublisher(redis, stream=stream)
    event = Event(type="e", aggregate_type="orders")
    await publisher.publish(event)
    async with consuming(redis, stream, handler, claim_idle=1, max_deliveries=3):
        await until(lambda: dead_count(redis, f"{stream}:dead", 1), timeout=30)
    ((_, fields),) = await redis.xrange(f"{stream}:dead")
    assert fields[b"dead-letter-deliveries"] == b"3"
    assert [r["attempts"] for r in await inbox.failed()] == [3]


async def test_stopping_makes_a_held_entry_reclaimable_at_once(
    db: Any, redis: Redis, unique: str
) -> None:
    stream = f"{unique}:orders"
    runs: list[str] = []

    @inbox_guard(Inbox(db, consumer="billing"), backoff=Backoff(initial=30, maximum=30))
    async def handler(event: Event, session: Any, *, attempt: int) -> None:
        runs.append(f"attempt {attempt}")
        if attempt == 1:
            raise ConnectionError("later")

    await RedisStreamsPublisher(redis, stream=stream).publish(
        Event(type="e", aggregate_type="orders", aggregate_id="o-1")
    )
    # Ordered: the retry is held in the process for its 30 s, then the consumer stops.
    async with consuming(redis, stream, handler, claim_idle=120, ordered=True, consumer="one"):
        await until(lambda: runs == ["attempt 1"])
    async with consuming(redis, stream, handler, claim_idle=120, consumer="two"):
        await until(lambda: runs == ["attempt 1", "attempt 2"], timeout=15)
        await until(lambda: no_pending(redis, stream))


async def test_a_slow_handler_s_entry_is_kept_alive_not_reclaimed_by_another_consumer(
    db: Any, redis: Redis, unique: str
) -> None:
    stream = f"{unique}:orders"
    runs: list[str] = []
    held_by: list[Any] = []

    def slow() -> Any:
        # A guard of its own per consumer, as in two processes: one guard would make the
        # second delivery wait for the first in the process.
        @inbox_guard(Inbox(db, consumer="billing"))
        async def handler(event: Event, session: Any) -> None:
            runs.append(event.id)
            await asyncio.sleep(3)  # three times claim_idle
            # The inbox would absorb a second delivery; Redis shows whether there was one.
            held_by.extend(await redis.xpending_range(stream, "billing", "-", "+", 10))

        return handler

    event = Event(type="e", aggregate_type="orders")
    await RedisStreamsPublisher(redis, stream=stream).publish(event)
    async with consuming(redis, stream, slow(), claim_idle=1, consumer="one"):
        await until(lambda: runs == [event.id])
        async with consuming(redis, stream, slow(), claim_idle=1, consumer="two"):
            await until(lambda: no_pending(redis, stream), timeout=30)
    assert runs == [event.id]
    (entry,) = held_by
    assert entry["consumer"] == b"one" and entry["times_delivered"] == 1


async def test_a_group_that_vanished_is_created_again(db: Any, redis: Redis, unique: str) -> None:
    stream = f"{unique}:orders"
    guarded = guarded_billing(db)
    publisher = RedisStreamsPublisher(redis, stream=stream)
    first, second = (Event(type="e", aggregate_type="orders") for _ in range(2))
    async with consuming(redis, stream, guarded, claim_idle=1):
        await publisher.publish(first)
        await until(lambda: no_pending_and_read(redis, stream))
        await redis.delete(stream)  # as a Redis restarted without its data: no group either
        await publisher.publish(second)
        await until(lambda: invoices(db, 2), timeout=30)
    assert sorted(d["event"] for d in await db.invoices.find().to_list(None)) == sorted(
        [first.id, second.id]
    )


async def no_pending_and_read(redis: Redis, stream: str) -> bool:
    groups = await redis.xinfo_groups(stream)
    return bool(groups) and groups[0]["lag"] == 0 and groups[0]["pending"] == 0


async def invoices(db: Any, wanted: int) -> bool:
    return await db.invoices.count_documents({}) >= wanted


HEADER_NAMES = st.from_regex(r"[a-z][a-z0-9_.\-]{0,20}", fullmatch=True)
TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=30)


@st.composite
def events(draw: st.DrawFn) -> Event:
    headers = draw(st.dictionaries(HEADER_NAMES, TEXT.map(str.strip), max_size=4))
    try:
        return Event(
            type=draw(TEXT.filter(str.strip)),
            aggregate_type=draw(st.none() | st.just("orders")),
            aggregate_id=draw(st.none() | st.integers() | TEXT.filter(str.strip)),
            sequence=draw(st.none() | st.integers(min_value=1, max_value=10**6)),
            headers=headers,
            payload=draw(st.dictionaries(TEXT, st.none() | st.integers() | TEXT, max_size=3)),
        )
    except ValueError:  # a reserved or invalid header, say: not an event anyone can send
        assume(False)
        raise


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(event=events())
async def test_any_event_comes_back_whole_from_its_entry(
    redis: Redis, unique: str, event: Event
) -> None:
    stream = f"{unique}:any"
    await RedisStreamsPublisher(redis, stream=stream, maxlen=None).publish(event)
    entry_id, fields = (await redis.xrevrange(stream, count=1))[0]
    await redis.xdel(stream, entry_id)
    assert Event.from_json(fields[b"body"]) == event
    headers = json.loads(fields[b"headers"])
    assert headers == message_headers(event)
    assert fields[b"event-id"].decode() == event.id
    assert (b"aggregate-id" in fields) == (event.aggregate_id is not None)


async def test_a_client_that_decodes_responses_consumes_alike(db: Any, unique: str) -> None:
    redis = Redis.from_url(REDIS_URL, decode_responses=True)
    stream = f"{unique}:orders"
    try:
        good = Event(type="e", aggregate_type="orders")
        await RedisStreamsPublisher(redis, stream=stream).publish(good)
        await redis.xadd(stream, {"body": "{}"})  # no event id
        async with consuming(redis, stream, guarded_billing(db)):
            await until(lambda: redis.exists(f"{stream}:dead"), timeout=15)
            await until(lambda: invoices(db, 1), timeout=15)
            await until(lambda: no_pending(redis, stream))
        assert [d["event"] for d in await db.invoices.find().to_list(None)] == [good.id]
        ((_, dead),) = await redis.xrange(f"{stream}:dead")
        assert "no id to deduplicate on" in dead["dead-letter-reason"]
    finally:
        await redis.delete(stream, f"{stream}:dead")
        await redis.aclose()


async def test_a_decoding_client_meeting_an_entry_that_is_not_utf8_stops_saying_why(
    db: Any, redis: Redis, unique: str
) -> None:
    # A foreign producer's binary entry: redis-py's decoder raised UnicodeDecodeError out of
    # the consumer, and again at every restart, without a word of what to do.
    stream = f"{unique}:orders"
    await redis.xadd(stream, {"event-id": b"\xff\xfe", "body": b"\x80\x81"})
    decoding = Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        with pytest.raises(ConfigurationError, match="give consume_redis a client without it"):
            await asyncio.wait_for(
                consume_redis(decoding, stream, "billing", guarded_billing(db)), 15
            )
    finally:
        await decoding.aclose()
    # The raw client reads it, and dead-letters it as no Event.
    async with consuming(redis, stream, guarded_billing(db), claim_idle=1):
        await until(lambda: redis.exists(f"{stream}:dead"), timeout=15)
