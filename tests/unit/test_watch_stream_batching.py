"""How ``WatchSource``'s stream closes a batch, against a fake PyMongo change stream: at once
when the driver holds nothing more, unless the batch's first getMore brought more than one
change (a burst), when it keeps asking while changes keep coming, up to ``max_wait``."""

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


async def test_a_getmore_that_brought_many_keeps_the_batch_asking_while_changes_come() -> None:
    fake = FakeChangeStream(buffer=[1, 2], arrivals=[3, 4, 5])
    stream = await WatchSource(FakeCollection(fake)).open()

    batch = await stream.next_batch(100, max_wait=5.0)

    assert numbers(batch.changes) == [1, 2, 3, 4, 5]
    assert fake.getmores == 4  # three changes, then the empty one that closed the batch


async def test_a_burst_s_batch_still_closes_at_max_wait() -> None:
    fake = FakeChangeStream(buffer=[1, 2], arrivals=list(range(3, 1000)), delay=0.01)
    stream = await WatchSource(FakeCollection(fake)).open()
    loop = asyncio.get_running_loop()

    start = loop.time()
    batch = await stream.next_batch(1000, max_wait=0.1)

    assert loop.time() - start < 1.0
    assert 2 <= len(batch.changes) < 100


async def test_a_steady_trickle_after_a_burst_goes_out_one_change_at_a_time() -> None:
    fake = FakeChangeStream(buffer=[1, 2], arrivals=[])
    stream = await WatchSource(FakeCollection(fake)).open()
    assert numbers((await stream.next_batch(100, max_wait=5.0)).changes) == [1, 2]

    # One change per getMore, each soon after the last: a trickle, not a burst.
    fake.arrivals.extend({"operationType": "insert", "n": n} for n in range(3, 9))
    sizes = [len((await stream.next_batch(100, max_wait=5.0)).changes) for _ in range(6)]

    assert sizes == [1] * 6
