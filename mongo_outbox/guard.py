"""``inbox_guard``: run a handler once per message against an ``Inbox``.

The guard checks what it is given (an async handler, a message id it can deduplicate on),
keeps deliveries of one message in a process from racing, and hands each delivery to
``mongo_outbox._inbox_attempts``, which runs the attempt in the inbox's mode and decides what
becomes of a failure. Each delivery runs in a consumer span, the child of the trace context
the event carries (``tracing.py``).

With ``upcasters`` the guard brings each event to its type's latest version before the handler
sees it, inside the attempt: an event it cannot bring there (newer than this consumer, or older
than its first step) is dead-lettered at once, as is an ``IncompatibleEventError`` the handler
raises (``payload_as``). Its inbox record keeps the event as it arrived, so once a reader that
knows it is deployed, ``Inbox.requeue`` and a redelivery handle it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo.errors import PyMongoError

from mongo_outbox import metrics
from mongo_outbox._callables import is_async_callable
from mongo_outbox._inbox_attempts import Attempts
from mongo_outbox._inbox_store import InboxStore
from mongo_outbox.backoff import Backoff
from mongo_outbox.errors import (
    ConfigurationError,
    DeadLettered,
    IncompatibleEventError,
    MessageIdentityError,
    PoisonMessage,
    RetryLater,
    describe,
)
from mongo_outbox.events import Event
from mongo_outbox.inbox import DeadLetter, Inbox, Outcome, Result
from mongo_outbox.settings import check_count
from mongo_outbox.tracing import consuming, outcome, record_failure
from mongo_outbox.upcasters import Upcasters

__all__ = ["MAX_ID_LENGTH", "Guarded", "check_message_id", "inbox_guard"]

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[None]]

MAX_ID_LENGTH = 512
"""The longest message id or source accepted, in characters."""


def inbox_guard(
    inbox: Inbox,
    *,
    max_attempts: int = 5,
    backoff: Backoff | None = None,
    dead_letter: DeadLetter | None = None,
    upcasters: Upcasters | None = None,
) -> Callable[[Handler], Guarded]:
    """Decorate ``async def handler(event, session)`` so it runs once per message.

    The decorated function returns ``True`` when it handled the event now and ``False`` for a
    duplicate; it raises ``RetryLater`` when the handler failed for now, and ``DeadLettered``
    once a message is poison (the handler raised ``PoisonMessage``, or ``max_attempts`` failed).
    A handler that takes an ``attempt`` keyword gets the attempt number (1 for the first).
    The handler and ``dead_letter`` must be coroutine functions (or objects whose ``__call__``
    is one): a plain function's side effects would run before the guard could refuse it.
    With ``upcasters`` the handler gets each event brought to its type's latest version; an
    event they cannot bring there is dead-lettered (``IncompatibleEventError``).
    """
    if not isinstance(inbox, Inbox):
        raise TypeError(f"inbox_guard needs an Inbox, not {type(inbox).__name__}")
    max_attempts = check_count(max_attempts, "inbox_guard.max_attempts")
    if backoff is not None and not isinstance(backoff, Backoff):
        raise ConfigurationError(
            f"inbox_guard.backoff must be a Backoff, not {type(backoff).__name__}",
            setting="inbox_guard.backoff",
        )
    if dead_letter is not None:
        _require_coroutine(dead_letter, "dead_letter")
    if upcasters is not None and not isinstance(upcasters, Upcasters):
        raise ConfigurationError(
            f"inbox_guard.upcasters must be Upcasters, not {type(upcasters).__name__}",
            setting="inbox_guard.upcasters",
        )

    def decorate(handler: Handler) -> Guarded:
        return Guarded(
            inbox, handler, max_attempts, backoff or Backoff(), dead_letter, upcasters=upcasters
        )

    return decorate


def check_message_id(message_id: object, *, what: str = "message id") -> str:
    """``message_id`` if it is a non-empty ``str`` of at most ``MAX_ID_LENGTH`` characters;
    anything else raises ``MessageIdentityError`` (``0`` and ``"0"`` must not be two ids, nor
    ``0`` mean "none")."""
    if message_id is None or message_id == "":
        raise MessageIdentityError(
            f"no id to deduplicate on: the {what} is missing", message_id=message_id
        )
    if not isinstance(message_id, str):
        shown = repr(message_id)[:80]
        raise MessageIdentityError(
            f"a {what} must be a non-empty str, not {type(message_id).__name__} {shown}",
            message_id=message_id,
        )
    if len(message_id) > MAX_ID_LENGTH:
        raise MessageIdentityError(
            f"a {what} must be at most {MAX_ID_LENGTH} characters, not {len(message_id)}",
            message_id=message_id,
        )
    return message_id


class Guarded:
    """A handler wrapped by ``inbox_guard``; call it, or use ``handle`` for the full outcome."""

    def __init__(
        self,
        inbox: Inbox,
        handler: Handler,
        max_attempts: int,
        backoff: Backoff,
        dead_letter: DeadLetter | None,
        *,
        upcasters: Upcasters | None = None,
    ) -> None:
        _require_coroutine(handler, "handler")
        self.upcasters = upcasters
        self.inbox = inbox
        self.handler = handler
        self.handler_name = qualified_name(handler)
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.dead_letter = dead_letter
        self.store = InboxStore(inbox)
        self._wants_attempt = "attempt" in inspect.signature(handler).parameters
        self._attempts = Attempts(
            self.store,
            self._run,
            max_attempts=max_attempts,
            backoff=backoff,
            dead_letter=dead_letter,
        )
        self._registered = False
        # Deliveries of one message in this process wait for each other instead of racing.
        self._busy: dict[tuple[str, str], _Busy] = {}
        self.__name__ = getattr(handler, "__name__", "guarded")
        self.__doc__ = handler.__doc__

    async def __call__(
        self,
        event: Event,
        *,
        message_id: str | None = None,
        source: str | None = None,
        last_delivery: bool = False,
    ) -> bool:
        result = await self.handle(
            event, message_id=message_id, source=source, last_delivery=last_delivery
        )
        if result.outcome is Outcome.RETRY:
            raise RetryLater(
                result.error or "retry later", attempt=result.attempt, delay=result.delay
            )
        if result.outcome is Outcome.DEAD_LETTERED:
            raise DeadLettered(result.error or "dead-lettered", attempt=result.attempt)
        return result.outcome is Outcome.HANDLED

    async def handle(
        self,
        event: Event,
        *,
        message_id: str | None = None,
        source: str | None = None,
        last_delivery: bool = False,
    ) -> Result:
        """Run the handler unless this message was handled; never raise for its failures.

        ``message_id`` defaults to the event id, ``source`` to the event's aggregate type.
        ``last_delivery`` says that the broker will not deliver this message again: a failure
        that would be retried is dead-lettered instead.
        """
        message_id = check_message_id(event.id if message_id is None else message_id)
        source = (event.aggregate_type or "") if source is None else source
        if source != "":  # no source at all is a source of its own
            check_message_id(source, what="source")
        with consuming(
            event, message_id=message_id, source=source, consumer=self.inbox.consumer
        ) as span:
            result = await self._handle(event, message_id, source, last_delivery)
            if span is not None:
                outcome(span, result.outcome.value, result.attempt, result.error)
        metrics.inbox_outcome(self.inbox.consumer, result.outcome.value)
        return result

    async def _handle(
        self, event: Event, message_id: str, source: str, last_delivery: bool
    ) -> Result:
        identity = self.store.identity(source, message_id)
        key = (source, message_id)
        busy = self._busy.setdefault(key, _Busy())
        busy.users += 1
        try:
            async with busy.lock:
                transactional = await self.inbox.prepare()
                await self._register()
                if transactional:
                    return await self._attempts.transactional(event, identity, last_delivery)
                return await self._attempts.leased(event, identity, last_delivery)
        except PyMongoError as error:
            # The inbox itself could not be read or written (MongoDB unreachable, say): not the
            # message's fault, so not an attempt, and no reason to stop the consumer.
            log.warning("inbox of %s unavailable, retry later: %s", self.inbox.consumer, error)
            return Result(Outcome.RETRY, 0, self.backoff.delay(1), f"inbox unavailable: {error}")
        finally:
            busy.users -= 1
            if not busy.users:
                del self._busy[key]

    async def _register(self) -> None:
        if self._registered:
            return
        previous = await self.store.register(self.handler_name)
        self._registered = True
        if previous is not None:
            log.warning(
                "consumer %r of inbox %s was used by handler %s and now by %s: one consumer name "
                "must never be shared by two handlers, each would skip the messages the other "
                "handled (ignore this once after renaming a handler)",
                self.inbox.consumer,
                self.inbox.collection.name,
                previous,
                self.handler_name,
            )

    async def _run(self, event: Event, session: Any, attempt: int) -> None:
        with metrics.handler_timer(self.inbox.consumer):
            try:
                if self.upcasters is not None:
                    # The handler's copy only: the record and the dead letter keep the event
                    # as it arrived, to be read again by a later deploy.
                    event = self.upcasters.upcast(event, reader=f"consumer {self.inbox.consumer}")
                if self._wants_attempt:
                    await self.handler(event, session, attempt=attempt)
                else:
                    await self.handler(event, session)
            except IncompatibleEventError as error:
                # No retry reads it before a deploy does: dead-letter it now, requeue it then.
                record_failure(error)
                raise PoisonMessage(describe(error)) from error
            except Exception as error:
                record_failure(error)
                raise


def qualified_name(handler: Callable[..., Any]) -> str:
    """``module.qualname`` of a function, of a ``partial``'s function, or of a callable
    object's class: the same handler gets the same name in every process."""
    target: Any = handler
    while isinstance(target, functools.partial):
        target = target.func
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target)
    return f"{target.__module__}.{target.__qualname__}"


def _require_coroutine(function: object, what: str) -> None:
    if is_async_callable(function):
        return
    raise TypeError(
        f"the {what} must be an async function (async def), not {function!r}: the guard "
        "awaits it, and a plain function's side effects would run on every retry"
    )


class _Busy:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0
