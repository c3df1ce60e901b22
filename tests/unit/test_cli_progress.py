"""``mongo_outbox.cli.progress``: on a terminal (a real pseudo-terminal here) one line redrawn in
place with counts, rate and time, ending on the final count; elsewhere plain lines every
``every`` seconds and a last one, and nothing at all for short work."""

from __future__ import annotations

import asyncio
import io
import os
import pty
from collections.abc import Iterator
from typing import TextIO

import pytest

from mongo_outbox.cli import progress as module
from mongo_outbox.cli.progress import Progress, progress


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def terminal() -> Iterator[tuple[TextIO, int]]:
    """A real pseudo-terminal: the stream writes to its slave side, the test reads the master."""
    master, slave = pty.openpty()
    stream = open(slave, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    yield stream, master
    stream.close()
    os.close(master)


def read(master: int) -> str:
    return os.read(master, 65536).decode()


def test_plain_output_prints_nothing_for_work_shorter_than_every() -> None:
    out, clock = io.StringIO(), Clock()
    shown = Progress("requeue", "events", total=3, stream=out, every=10, clock=clock)
    assert not shown.tty
    clock.now += 2
    shown.add(3)
    shown.finish()
    assert out.getvalue() == ""


def test_plain_output_prints_a_line_every_interval_and_a_last_one() -> None:
    out, clock = io.StringIO(), Clock()
    shown = Progress("requeue", "events", total=5000, stream=out, every=10, clock=clock)
    clock.now += 5
    shown.add(1000)  # not yet 10 s: nothing
    clock.now += 5
    shown.add(1000)  # 10 s: a line
    clock.now += 3
    shown.add(1000)  # 3 s after it: nothing
    clock.now += 7
    shown.add(2000)
    clock.now += 0.5
    shown.finish()
    assert out.getvalue().splitlines() == [
        "requeue: 2,000/5,000 events (40%), 200/s, 10.0s",
        "requeue: 5,000/5,000 events (100%), 250/s, 20.0s",
        "requeue: 5,000/5,000 events (100%), 244/s, 20.5s",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_without_a_total_it_shows_the_count_and_rate_and_long_times_in_minutes() -> None:
    out, clock = io.StringIO(), Clock()
    shown = Progress("replay", "events", stream=out, every=60, clock=clock)
    clock.now += 125
    shown.add(250_000)
    assert out.getvalue() == "replay: 250,000 events, 2,000/s, 2m05s\n"


def test_a_terminal_gets_one_line_redrawn_in_place_ending_on_the_final_count(
    terminal: tuple[TextIO, int],
) -> None:
    stream, master = terminal
    clock = Clock()
    shown = Progress("requeue", "events", total=300, stream=stream, every=10, clock=clock)
    assert shown.tty
    clock.now += 1
    shown.add(100)
    shown.add(100)  # within a tenth of a second: not redrawn
    clock.now += 1
    shown.add(100)
    shown.finish()
    shown.finish()  # once only
    written = read(master)
    while not written.endswith("\n"):  # a read returns what the terminal holds so far
        written += read(master)
    assert written == (
        "\rrequeue: 100/300 events (33%), 100/s, 1.0s\x1b[K"
        "\rrequeue: 300/300 events (100%), 150/s, 2.0s\x1b[K"
        "\rrequeue: 300/300 events (100%), 150/s, 2.0s\x1b[K\r\n"  # the terminal's \n is \r\n
    )


async def test_the_line_moves_on_while_one_long_call_runs(
    terminal: tuple[TextIO, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    stream, master = terminal
    monkeypatch.setattr(module, "REDRAW", 0.01)
    written = ""
    async with progress("ensure-indexes", "documents", total=10, stream=stream) as shown:
        # Nothing is counted, yet the line is redrawn (its time moves on).
        while written.count("\r") < 3:
            written += await asyncio.to_thread(read, master)
        shown.add(10)
    while not written.endswith("\n"):
        written += await asyncio.to_thread(read, master)
    redrawn = [line for line in written.split("\r") if line]
    assert redrawn[0].startswith("ensure-indexes: 0/10 documents (0%), 0/s, ")
    assert redrawn[-1] == "\n"  # the final line ends with the terminal's \r\n
    assert redrawn[-2].startswith("ensure-indexes: 10/10 documents (100%), ")


async def test_follow_reads_the_works_own_counter_and_the_last_value_at_the_end() -> None:
    out = io.StringIO()
    published = [0]
    async with progress("drain", "events", follow=lambda: published[0], stream=out, every=0):
        for _ in range(3):
            published[0] += 2
            await asyncio.sleep(0.05)
    lines = out.getvalue().splitlines()
    assert lines and all(line.startswith("drain: ") for line in lines)
    assert lines[-1].startswith("drain: 6 events, ")


def test_the_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONGO_OUTBOX_PROGRESS_EVERY", "2.5")
    assert Progress("x", "y", stream=io.StringIO()).every == 2.5
    monkeypatch.setenv("MONGO_OUTBOX_PROGRESS_EVERY", "soon")
    assert Progress("x", "y", stream=io.StringIO()).every == module.EVERY
