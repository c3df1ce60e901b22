"""Progress of the command line's long work (a requeue, a replay, a drain, index builds): counts
and rate on stderr, so that stdout keeps only the command's result and scripts reading it see no
difference.

- **On a terminal** one line is redrawn in place, at most ten times a second, and left showing
  the final count, rate and time: ``requeue: 1,200/5,000 events (24%), 240/s, 5.0s``.
- **Otherwise** (a pipe, a log file, CI) a plain line is written every ``every`` seconds while the
  work goes on (``MONGO_OUTBOX_PROGRESS_EVERY``, 10 s by default), and a last one when it ends if
  any was written: a log shows long work going on and how it ended, and short work adds nothing.

The helper knows nothing of what it counts. Work reports counts through ``Progress.add`` (a
plain callback, for work done in chunks), or ``progress(follow=...)`` reads a counter the work
keeps itself (a relay's ``stats.published``). While a single long call runs, the line's time
still moves, so an operator sees it is not stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import TextIO

EVERY_ENV = "MONGO_OUTBOX_PROGRESS_EVERY"
EVERY = 10.0
"""Seconds between two plain lines when stderr is not a terminal."""
REDRAW = 0.1
"""Seconds between two redraws of the terminal's line."""


class Progress:
    """Counts of one piece of work, shown on ``stream`` (stderr by default).

    Args:
        what: the work's name, at the start of each line (``requeue``).
        unit: what is counted, plural (``events``).
        total: how many there are to do, when known: adds ``/total (percent)``.
        stream: where to show it; a terminal gets the redrawn line.
        every: seconds between plain lines (not a terminal); default ``EVERY`` or the
            ``MONGO_OUTBOX_PROGRESS_EVERY`` environment variable.
        clock: seconds, monotonic (tests give their own).
    """

    def __init__(
        self,
        what: str,
        unit: str,
        *,
        total: int | None = None,
        stream: TextIO | None = None,
        every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.unit, self.total = what, unit, total
        self.stream = stream if stream is not None else sys.stderr
        self.every = every if every is not None else _every_from_environment()
        self.clock = clock
        self.done = 0
        self.started = clock()
        self.tty = _is_terminal(self.stream)
        self._shown_at: float | None = None  # when a line was last shown
        self._finished = False

    def add(self, count: int) -> None:
        """Count ``count`` more done (a callback for work that reports chunks)."""
        self.done += count
        self.show()

    def set(self, done: int) -> None:
        """The work has done ``done`` in all (for a counter the work keeps)."""
        self.done = done
        self.show()

    def show(self) -> None:
        """Show the line if it is due: a terminal's every ``REDRAW`` seconds, a plain one every
        ``every`` seconds (the first after ``every`` seconds of work)."""
        now = self.clock()
        if self._finished:
            return
        if self.tty:
            if self._shown_at is None or now - self._shown_at >= REDRAW:
                self._write("\r" + self.line(now) + "\x1b[K")
                self._shown_at = now
            return
        last = self._shown_at if self._shown_at is not None else self.started
        if now - last >= self.every:
            self._write(self.line(now) + "\n")
            self._shown_at = now

    def finish(self) -> None:
        """End the display: a terminal's line shows the final count and the cursor moves to
        the next line; a plain last line is written if any line was."""
        if self._finished:
            return
        now = self.clock()
        if self.tty:
            self._write("\r" + self.line(now) + "\x1b[K\n")
        elif self._shown_at is not None:
            self._write(self.line(now) + "\n")
        self._finished = True

    def line(self, now: float | None = None) -> str:
        elapsed = max((now if now is not None else self.clock()) - self.started, 0.0)
        count = f"{self.done:,}"
        if self.total is not None:
            count += f"/{self.total:,}"
        count += f" {self.unit}"
        if self.total:
            count += f" ({min(100 * self.done // self.total, 100)}%)"
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return f"{self.what}: {count}, {rate:,.0f}/s, {_duration(elapsed)}"

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # a closed stderr loses nothing else
            self.stream.write(text)
            self.stream.flush()


@contextlib.asynccontextmanager
async def progress(
    what: str,
    unit: str,
    *,
    total: int | None = None,
    follow: Callable[[], int] | None = None,
    stream: TextIO | None = None,
    every: float | None = None,
) -> AsyncIterator[Progress]:
    """Show a ``Progress`` while the block runs: its time moves on even while the work is in
    one long call; ``follow()``, if given, is read as the count done at each redraw and at the
    end. The display ends with the block, also when it raises."""
    shown = Progress(what, unit, total=total, stream=stream, every=every)

    def update() -> None:
        if follow is not None:
            shown.set(follow())
        else:
            shown.show()

    async def tick() -> None:
        pause = REDRAW if shown.tty else min(shown.every, 1.0)
        while True:
            await asyncio.sleep(pause)
            update()

    ticker = asyncio.ensure_future(tick())
    try:
        yield shown
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        if follow is not None:
            shown.done = follow()
        shown.finish()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _every_from_environment() -> float:
    given = os.environ.get(EVERY_ENV, "")
    try:
        every = float(given) if given else EVERY
    except ValueError:
        every = EVERY
    return max(every, 0.0)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"
