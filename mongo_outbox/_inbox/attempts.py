"""One attempt at handling a delivery, in either inbox mode, and what a failure leads to:
a retry after a backoff delay, or the dead letter once the handler refused the message for good
or it is out of attempts.

``inbox_guard`` chooses the mode and keeps deliveries of one message in a process apart; the
records are written through ``InboxStore``; this module decides what becomes of the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from pymongo.errors import ConnectionFailure, DuplicateKeyError, OperationFailure, PyMongoError

from mongo_outbox._driver import start_session
from mongo_outbox._inbox.outcomes import DeadLetter, Outcome, Result
from mongo_outbox._inbox.store import ClaimRefused, Identity, InboxStore, MessageClaim, attempts_of
from mongo_outbox.errors import PoisonMessage, describe
from mongo_outbox.events import Event, utc_now
from mongo_outbox.settings import Backoff

log = logging.getLogger(__name__)

Run = Callable[[Event, Any, int], Awaitable[None]]
"""``run(event, session, attempt)``: the handler, called the way it wants to be."""

T = TypeVar("T")


class Attempts:
    """Runs one attempt of a handler against an inbox's records, in either mode."""

    def __init__(
        self,
        store: InboxStore,
        run: Run,
        *,
        max_attempts: int,
        backoff: Backoff,
        dead_letter: DeadLetter | None,
    ) -> None:
        self.store = store
        self.run = run
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.dead_letter = dead_letter

    async def transactional(self, event: Event, identity: Identity, last: bool) -> Result:
        stop = _Stop()
        return await stop.around(self._transactional(event, identity, last, stop))

    async def _transactional(
        self, event: Event, identity: Identity, last: bool, stop: _Stop
    ) -> Result:
        before: dict[str, Any] | None = None

        async def attempt_in_transaction(session: Any) -> None:
            nonlocal before
            try:
                # The one write the inbox adds: done, in the handler's transaction.
                before = await self.store.mark_done(identity, event, session)
            except DuplicateKeyError as error:
                # Two first deliveries raced to create the record. Only this write's duplicate
                # key means that: the handler's own DuplicateKeyError is a handler failure.
                raise _Racing from error
            if before is not None and before.get("status") in ("done", "failed"):
                raise _Duplicate  # abort: a duplicate leaves the record as it was
            held = _lease_left(before)
            if held is not None:
                # A leased guard of this consumer runs it now (a deploy switching modes):
                # taking it over would run the effect a second time.
                raise _Held(held)
            if before is not None and (
                before.get("verdict") or attempts_of(before) >= self.max_attempts
            ):
                raise _GiveUp  # abort: only the dead letter remains to be done
            with stop.cancellable():
                await self.run(event, session, attempts_of(before) + 1)

        try:
            async with await start_session(self.store.inbox.db.client) as session:
                await session.with_transaction(attempt_in_transaction)
        except _Duplicate:
            return Result(Outcome.DUPLICATE, attempts_of(before))
        except _Held as held:
            return Result(Outcome.RETRY, attempts_of(before), held.wait, "in progress")
        except _GiveUp:
            return await self._give_up(event, identity, None, attempts_of(before), before)
        except PoisonMessage as error:
            return await self._to_dead_letter(
                event, identity, None, attempts_of(before) + 1, str(error)
            )
        except _Racing:
            # Whichever lost tries again, and will find the winner's record.
            return Result(Outcome.RETRY, attempts_of(before), self.backoff.delay(1), "racing")
        except Exception as error:  # noqa: BLE001 - any handler failure is retried or dead-lettered
            if _is_conflict(error) or isinstance(error, ConnectionFailure):
                # Another transaction won, or MongoDB was out of reach: not the message's fault,
                # so not an attempt that counts towards max_attempts (a duplicate, or every
                # message during an outage, would be dead-lettered). The transaction rolled
                # back the record's count too.
                text = describe(error)
                return Result(Outcome.RETRY, attempts_of(before), self.backoff.delay(1), text)
            attempt = attempts_of(before) + 1
            return await self._failed(event, identity, None, attempt, error, last)
        return Result(Outcome.HANDLED, attempts_of(before) + 1)

    async def leased(self, event: Event, identity: Identity, last: bool) -> Result:
        stop = _Stop()
        return await stop.around(self._leased(event, identity, last, stop))

    async def _leased(self, event: Event, identity: Identity, last: bool, stop: _Stop) -> Result:
        claim = await self.store.claim(identity, event)
        if isinstance(claim, ClaimRefused):
            if claim.status in ("done", "failed"):
                return Result(Outcome.DUPLICATE, claim.attempts)
            if claim.status == "missing":
                return Result(Outcome.RETRY, 0, self.backoff.delay(1), "record vanished")
            # Another delivery holds it: come back when its lease ends.
            return Result(Outcome.RETRY, claim.attempts, claim.wait, "in progress")
        return await self._claimed(event, identity, claim, last, stop)

    async def _let_go(self, claim: MessageClaim) -> None:
        try:
            await self.store.let_go(claim)
        except (asyncio.CancelledError, PyMongoError) as error:
            # Cut short (MongoDB out of reach for _SETTLE_WAIT): as after a crash.
            log.warning(
                "stopped while handling %s, its claim could not be let go (%s): the next "
                "delivery waits until it runs out (Inbox.processing_lease)",
                claim.identity["message_id"],
                describe(error) if isinstance(error, PyMongoError) else "given up on",
            )

    async def _claimed(
        self, event: Event, identity: Identity, claim: MessageClaim, last: bool, stop: _Stop
    ) -> Result:
        if claim.verdict is not None or claim.attempt > self.max_attempts:
            # The handler is done with this message (its dead letter failed, or a crash
            # followed its last attempt): do not run it again.
            return await self._give_up(event, identity, claim, claim.attempt - 1, None)
        try:
            with stop.cancellable():
                await self.run(event, None, claim.attempt)
        except asyncio.CancelledError:
            # A stop while the handler ran, or before it did (the guard lets no other
            # cancellation through): the consumer gives the message back to the broker, and
            # the claim goes with it, its attempt unspent. Kept, it made the next delivery wait
            # out the rest of the processing lease. Only here: once the handler has returned,
            # its effect is done, and a claim let go then would be run again.
            await self._let_go(claim)
            raise
        except PoisonMessage as error:
            return await self._to_dead_letter(event, identity, claim, claim.attempt, str(error))
        except Exception as error:  # noqa: BLE001 - any handler failure is retried or dead-lettered
            return await self._failed(event, identity, claim, claim.attempt, error, last)
        if not await self.store.finish(claim):
            self._lost(claim, "done")
        return Result(Outcome.HANDLED, claim.attempt)

    async def _give_up(
        self,
        event: Event,
        identity: Identity,
        claim: MessageClaim | None,
        attempt: int,
        before: dict[str, Any] | None,
    ) -> Result:
        record: dict[str, Any] = before or {}
        verdict = claim.verdict if claim is not None else record.get("verdict")
        last_error = claim.last_error if claim is not None else record.get("last_error")
        # Without a verdict, the last attempt never recorded its end (a crash, a lease overrun)
        # or max_attempts was lowered: what is known is the last error recorded, if any.
        reason = verdict or f"gave up after {attempt}; last error recorded: {last_error}"
        return await self._to_dead_letter(event, identity, claim, attempt, reason)

    async def _failed(
        self,
        event: Event,
        identity: Identity,
        claim: MessageClaim | None,
        attempt: int,
        error: BaseException,
        last: bool,
    ) -> Result:
        text = describe(error)
        if attempt >= self.max_attempts:
            reason = f"gave up after {attempt}: {text}"
            return await self._to_dead_letter(event, identity, claim, attempt, reason)
        if last:
            reason = f"gave up after {attempt} on the broker's last delivery: {text}"
            return await self._to_dead_letter(event, identity, claim, attempt, reason)
        delay = self.backoff.delay(attempt)
        log.warning(
            "handling %s failed (attempt %d), retry in %.1fs: %s",
            identity["message_id"],
            attempt,
            delay,
            text,
        )
        await self._save(event, identity, claim, "retrying", attempt, text)
        return Result(Outcome.RETRY, attempt, delay, text)

    async def _to_dead_letter(
        self,
        event: Event,
        identity: Identity,
        claim: MessageClaim | None,
        attempt: int,
        reason: str,
    ) -> Result:
        log.error("dead-lettering %s after attempt %d: %s", identity["message_id"], attempt, reason)
        # Dead letter first: if it fails, the message is retried rather than marked lost.
        if self.dead_letter is not None:
            try:
                await self.dead_letter(event, reason)
            except Exception as error:  # noqa: BLE001 - retried like a handler failure
                text = f"dead letter failed: {describe(error)}"
                # Let the claim go, keeping the verdict: the next delivery retries only the
                # dead letter, at once rather than after the lease, and never the handler.
                await self._save(event, identity, claim, "retrying", attempt, text, reason)
                return Result(Outcome.RETRY, attempt, self.backoff.delay(attempt), text)
        await self._save(event, identity, claim, "failed", attempt, reason)
        return Result(Outcome.DEAD_LETTERED, attempt, 0.0, reason)

    async def _save(
        self,
        event: Event,
        identity: Identity,
        claim: MessageClaim | None,
        status: str,
        attempt: int,
        error: str,
        verdict: str | None = None,
    ) -> None:
        try:
            if claim is None:
                await self.store.record(identity, status, attempt, error, event, verdict)
            elif not await self.store.release(claim, status, attempt, error, event, verdict):
                self._lost(claim, status)
        except PyMongoError:
            # The broker redelivers and the attempt is counted again; nothing is lost.
            log.exception("could not record the %s state of %s", status, identity["message_id"])

    def _lost(self, claim: MessageClaim, status: str) -> None:
        log.warning(
            "the claim on %s ran out and another delivery took it over before it could be "
            "marked %s: Inbox.processing_lease (%s) is shorter than the handler's run",
            claim.identity["message_id"],
            status,
            self.store.inbox.processing_lease,
        )


_SETTLE_WAIT = 2.0
"""Seconds a stop waits for an attempt's writes to settle what its handler did."""


class _Stop:
    """Where a stop lands in one attempt. A stop is the cancellation of the task handling the
    delivery (a consumer's stop, a ``wait_for`` given up on, FastStream's graceful timeout).

    It cancels the handler, whose work is unfinished: the message goes back to the broker. It
    never cuts short the writes that settle an attempt (the claim, the record marked done or
    released, the transaction's commit or abort): the attempt runs in a task of its own, which
    the stop cancels only while the handler runs; otherwise the stop waits for those writes to
    end (``_SETTLE_WAIT`` at most, then cuts them as a crash would), and a handler not yet
    started does not start. Cut short, such a write let go of a claim whose effect was done, to
    be run again at once; or left the transaction open on the server (PyMongo counts a commit
    or abort it sent as made), holding the message's record until the server's
    ``transactionLifetimeLimitSeconds``. A second cancellation stops the wait, not the writes.
    """

    def __init__(self) -> None:
        self.requested = False
        self._handler_runs = False

    async def around(self, attempt: Coroutine[Any, Any, T]) -> T:
        task: asyncio.Task[T] = asyncio.ensure_future(attempt)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_retrieved)
            if task.done():
                raise
            self.requested = True
            if self._handler_runs:
                task.cancel()
            # A second cancellation ends this wait, and leaves the writes to go on.
            await asyncio.wait([task], timeout=_SETTLE_WAIT)
            if not task.done():
                log.warning(
                    "stopped while an attempt settled, its writes were cut short after %gs "
                    "(MongoDB slow or out of reach): as after a crash, the message waits for "
                    "its claim or its transaction to run out",
                    _SETTLE_WAIT,
                )
                task.cancel()
            raise

    @contextlib.contextmanager
    def cancellable(self) -> Iterator[None]:
        """Inside, the handler runs, and a stop cancels it; a stop that came before raises."""
        if self.requested:
            raise asyncio.CancelledError
        self._handler_runs = True
        try:
            yield
        finally:
            self._handler_runs = False


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of an attempt no one may await any more (``_Stop``)."""
    if not task.cancelled():
        task.exception()


class _Duplicate(Exception):
    pass


class _Held(Exception):
    def __init__(self, wait: float) -> None:
        super().__init__(wait)
        self.wait = wait


def _lease_left(record: dict[str, Any] | None) -> float | None:
    """Seconds left of a live leased claim in ``record``; None if it holds none."""
    if record is None or record.get("status") != "processing":
        return None
    until = record.get("lease_until")
    if until is None:
        return None
    left = (until - utc_now()).total_seconds()
    return left if left > 0 else None


class _Racing(Exception):
    pass


class _GiveUp(Exception):
    pass


def _is_conflict(error: BaseException) -> bool:
    """Whether a transaction failed because another one touched the same documents.

    ``with_transaction`` retries labelled conflicts (and commits of unknown outcome) for up to
    two minutes; a labelled one that still reaches us ran out of that time, and the redelivery
    will find out whether it committed.
    """
    if not isinstance(error, PyMongoError):
        return False
    if error.has_error_label("TransientTransactionError") or error.has_error_label(
        "UnknownTransactionCommitResult"
    ):
        return True
    return isinstance(error, OperationFailure) and error.code == 112  # WriteConflict
