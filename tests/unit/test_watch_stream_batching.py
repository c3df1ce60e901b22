"""How ``WatchSource``'s stream closes a batch, against a fake PyMongo change stream: at once
when the driver holds nothing more, unless the last batch held more than one change (a burst),
when it keeps asking while changes keep coming, up to ``max_wait``."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from mongo_outbox.changestream import WatchSource


class _FakeCursor:
    def __init__(self, stream: FakeChangeStream) -> None:
        self.stream = stream

    def _has_next(self) -> bool:
        return bool(self.stream.buffer)


class FakeChangeStream:
    """A fake of PyMongo's ``AsyncChangeStream``: ``buffer`` is what the driver already
    holds; ``arrivals`` are changes a getMore brings, one per try_next, after ``delay``."""

    def __init__(self, buffer: list[int], arrivals: list[int], delay: float = 0.001) -> None:
        self.buffer = deque({"operationType": "insert", "n": n} for n in buffer)
        self.arrivals = deque({"operationType": "insert", "n": n} for n in arrivals)
        self.delay = delay
        self.alive = True
        self.resume_token = {"_data": "t"}
        self._cursor = _FakeCursor(self)
        self.getmores = 0

    async def try_next(self) -> dict[str, Any] | None:
        if self.buffer:
            return self.buffer.popleft()
        self.getmores += 1
        await asyncio.sleep(self.delay)
        return self.arrivals.popleft() if self.arrivals else None

    async def close(self) -> None:
        self.alive = False


class FakeCollection:
    def __init__(self, stream: FakeChangeStream) -> None:
        self.stream = stream

    async def watch(self, pipeline: Any, **options: Any) -> FakeChangeStream:
        return self.stream


def numbers(changes: list[dict[str, Any]]) -> list[int]:
    return [change["n"] for change in changes]


async def test_a_lone_change_closes_its_batch_without_another_getmore() -> None:
    fake = FakeChangeStream(buffer=[1], arrivals=[2])
    stream = await WatchSource(FakeCollection(fake)).open()

    batch = await stream.next_batch(100, max_wait=5.0)

    assert numbers(batch.changes) == [1]
    assert fake.getmores == 0


async def test_after_a_batch_of_many_the_next_keeps_asking_while_changes_come() -> None:
    fake = FakeChangeStream(buffer=[1, 2], arrivals=[])
    stream = await WatchSource(FakeCollection(fake)).open()
    assert numbers((await stream.next_batch(100, max_wait=5.0)).changes) == [1, 2]

    # A burst goes on: one change in hand, more arriving one getMore at a time.
    fake.buffer.append({"operationType": "insert", "n": 3})
    fake.arrivals.extend({"operationType": "insert", "n": n} for n in (4, 5, 6))
    batch = await stream.next_batch(100, max_wait=5.0)

    assert numbers(batch.changes) == [3, 4, 5, 6]
    assert fake.getmores == 4  # three changes, then the empty one that closed the batch


async def test_a_burst_s_batch_still_closes_at_max_wait() -> None:
    fake = FakeChangeStream(buffer=[1, 2], arrivals=list(range(3, 1000)), delay=0.01)
    stream = await WatchSource(FakeCollection(fake)).open()
    await stream.next_batch(100, max_wait=5.0)
    loop = asyncio.get_running_loop()

    start = loop.time()
    batch = await stream.next_batch(1000, max_wait=0.1)

    assert loop.time() - start < 1.0
    assert 2 <= len(batch.changes) < 100


async def test_a_batch_of_one_ends_the_burst() -> None:
    fake = FakeChangeStream(buffer=[1, 2], arrivals=[])
    stream = await WatchSource(FakeCollection(fake)).open()
    await stream.next_batch(100, max_wait=5.0)  # two: a burst
    fake.buffer.append({"operationType": "insert", "n": 3})
    assert numbers((await stream.next_batch(100, max_wait=5.0)).changes) == [3]  # one: over

    fake.buffer.append({"operationType": "insert", "n": 4})
    fake.arrivals.append({"operationType": "insert", "n": 5})
    getmores = fake.getmores
    batch = await stream.next_batch(100, max_wait=5.0)

    assert numbers(batch.changes) == [4]  # eager again: the arrival waits for the next batch
    assert fake.getmores == getmores
