"""The life every relay shares (``_relay/lifecycle.py``), on the smallest relay built on it:
its states, one loop at a time, a stop before the run or twice, and the last error. The polling,
change-stream and group relays run it against a database in tests/integration/relay."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mongo_outbox import UsageError
from mongo_outbox._relay.lifecycle import Lifecycle
from mongo_outbox.metrics import RelayGauges

LOG = logging.getLogger("tests.ticker")


class Ticker(Lifecycle):
    """A relay of nothing: it counts rounds until stopped, and raises ``error`` if given one."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.gauges = RelayGauges("ticker", "shop")
        super().__init__("ticker", LOG, self.gauges)
        self.rounds = 0
        self.error = error
        self.seen: list[str] = []
        self.ticked = asyncio.Event()

    async def run(self) -> None:
        with self._running():
            self._enter("active", "ticking")
            while not self._stopping.is_set():
                self.seen.append(self.state)
                self.rounds += 1
                self.ticked.set()
                if self.error is not None:
                    raise self.error
                await asyncio.sleep(0)

    async def drain(self) -> None:
        with self._exclusive("drain()"):
            await asyncio.sleep(0)


async def run_until_it_ticks(ticker: Ticker) -> asyncio.Task[None]:
    ticker.ticked.clear()
    task = asyncio.ensure_future(ticker.run())
    await asyncio.wait_for(ticker.ticked.wait(), 5)
    return task


async def test_a_relay_starts_runs_active_and_ends_stopped_with_one_log_line_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOG.name)
    ticker = Ticker()
    assert (ticker.state, ticker.gauges.state, ticker.last_error) == ("starting", "starting", None)
    task = await run_until_it_ticks(ticker)
    assert (ticker.state, ticker.gauges.state) == ("active", "active")
    ticker.stop()
    await asyncio.wait_for(task, 5)
    assert (ticker.state, ticker.gauges.state, ticker.last_error) == ("stopped", "stopped", None)
    assert set(ticker.seen) == {"active"}
    assert [r.getMessage() for r in caplog.records] == [
        "relay ticker: starting -> active (ticking)",
        "relay ticker: active -> stopped (stop() was called)",
    ]


async def test_a_second_loop_is_refused_while_one_runs_and_allowed_after_it() -> None:
    ticker = Ticker()
    task = await run_until_it_ticks(ticker)
    for second in (ticker.run(), ticker.drain()):
        with pytest.raises(UsageError, match=r"one relay object runs one loop at a time"):
            await second
    assert not task.done() and ticker.state == "active"  # the refusal left the first alone
    ticker.stop()
    await asyncio.wait_for(task, 5)
    await ticker.drain()  # the loop ended: the object is free again
    task = await run_until_it_ticks(ticker)
    ticker.stop()
    await asyncio.wait_for(task, 5)


async def test_a_stop_before_the_run_ends_that_run_at_once_and_only_that_one() -> None:
    ticker = Ticker()
    ticker.stop()
    await asyncio.wait_for(ticker.run(), 5)
    assert (ticker.rounds, ticker.state) == (0, "stopped")
    task = await run_until_it_ticks(ticker)  # the stop was consumed: this run relays
    assert ticker.state == "active"
    ticker.stop()
    await asyncio.wait_for(task, 5)


async def test_two_stops_end_the_run_once_and_leave_the_next_run_alone() -> None:
    ticker = Ticker()
    task = await run_until_it_ticks(ticker)
    ticker.stop()
    ticker.stop()
    await asyncio.wait_for(task, 5)
    assert ticker.state == "stopped"
    rounds = ticker.rounds
    task = await run_until_it_ticks(ticker)
    assert ticker.rounds > rounds and ticker.state == "active"
    ticker.stop()
    await asyncio.wait_for(task, 5)


async def test_a_run_that_raises_ends_failed_with_its_error_as_last_error() -> None:
    ticker = Ticker(error=RuntimeError("the broker is gone"))
    with pytest.raises(RuntimeError, match="the broker is gone"):
        await asyncio.wait_for(ticker.run(), 5)
    assert (ticker.state, ticker.gauges.state) == ("failed", "failed")
    assert ticker.last_error == "RuntimeError: the broker is gone"
    ticker.error = None
    task = await run_until_it_ticks(ticker)  # a failed run freed the object too
    assert ticker.state == "active"
    assert ticker.last_error == "RuntimeError: the broker is gone"  # the latest error met
    ticker.stop()
    await asyncio.wait_for(task, 5)


async def test_a_cancelled_run_ends_stopped_without_an_error() -> None:
    ticker = Ticker()
    task = await run_until_it_ticks(ticker)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (ticker.state, ticker.last_error) == ("stopped", None)
    await ticker.drain()  # and frees the object
