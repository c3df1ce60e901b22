"""The life of a relay, written once for the polling relay, the change-stream relay and the
relay group: its state, the last error it met, the flag ``stop()`` sets, and the rule that one
relay object runs one loop at a time.

``state`` starts as ``starting``; the relay itself moves it between ``standby`` and ``active``;
``run()`` ends it as ``stopped`` (after ``stop()`` or a cancellation) or ``failed`` (it raised,
and ``last_error`` says what). A ``stop()`` before ``run()`` makes that run return at once; the
run it ends consumes it, so the next ``run()`` relays again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mongo_outbox.errors import UsageError, describe
from mongo_outbox.status import State, transition

if TYPE_CHECKING:
    from mongo_outbox.metrics import RelayGauges


class Lifecycle:
    """The base of every relay: ``name``, ``state``, ``last_error`` and ``stop()``.

    Parameters:
        name: what ``status()`` and the log call the relay.
        log: the relay's logger, which gets one line per change of state.
        gauges: the relay's metrics, whose state follows the relay's.
    """

    def __init__(self, name: str, log: logging.Logger, gauges: RelayGauges | None = None) -> None:
        self.name = name
        self.state: State = "starting"
        self.last_error: str | None = None
        self._log = log
        self._state_gauges = gauges
        self._stopping = asyncio.Event()
        self._busy = False

    def stop(self) -> None:
        """Make ``run()`` return once its publishes in flight are confirmed (the rest of the
        round is released, due at once); before it started, at once."""
        self._stopping.set()

    def _enter(self, state: State, reason: str) -> None:
        self.state = transition(self._log, self.name, self.state, state, reason)
        if self._state_gauges is not None:
            self._state_gauges.state = self.state

    def _fail(self, error: BaseException) -> None:
        self.last_error = describe(error)
        self._enter("failed", self.last_error)

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Refuse a second loop of one relay object while one runs: two loops would share one
        stop flag, one set of counters and, for a change-stream relay, one lease."""
        if self._busy:
            raise UsageError(
                f"{what}: this relay is already running a loop (run(), drain() or "
                "publish_round()); one relay object runs one loop at a time: create another "
                "relay object (or process) to publish side by side"
            )
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Around the body of ``run()``: exclusive, and it ends in ``stopped`` or ``failed``.
        A relay that must clean up on cancellation (give no lease back, cancel its workers)
        does so inside, then re-raises."""
        with self._exclusive("run()"):
            try:
                yield
            except asyncio.CancelledError:
                self._stopping.clear()  # a stop made during this run was for it
                self._enter("stopped", "cancelled")
                raise
            except BaseException as error:
                self._stopping.clear()
                self._fail(error)
                raise
            self._stopping.clear()  # a stop is consumed by the run it ended
            self._enter("stopped", "stop() was called")
