"""The consumer side: ``Inbox`` and ``inbox_guard`` make a handler's effects happen once.

A message's identity is (consumer, source, message id). Its inbox record has a unique index on
that identity and an ``expire_at`` that a TTL index honours.

Transactional mode: the record is written with ``status: "done"`` in the same transaction as the
handler's own writes, so either both commit or neither does, whatever crashes when.
Leased mode: the record is claimed with ``status: "processing"`` for a processing lease, the
handler runs (told its attempt number), then the record is marked done. A crash leaves a claim
whose lease runs out, and the next delivery runs the handler again with the next attempt number:
its external calls must be idempotent (use the message id as the idempotency key).

This module holds the ``Inbox`` (where the records live and how long) and the guard that runs a
handler against it. The guard checks what it is given (an async handler, a message id it can
deduplicate on), keeps deliveries of one message in a process from racing, and hands each
delivery to ``mongo_outbox._inbox.attempts``, which runs the attempt in the inbox's mode and
decides what becomes of a failure (``Outcome``, ``Result``). Each delivery runs in a consumer
span, the child of the trace context the event carries (``tracing.py``).

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
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from bson.codec_options import CodecOptions, DatetimeConversion
from pymongo.errors import InvalidName, OperationFailure, PyMongoError

from mongo_outbox import metrics
from mongo_outbox._callables import is_async_callable
from mongo_outbox._inbox.attempts import Attempts
from mongo_outbox._inbox.outcomes import DeadLetter, Outcome, Result
from mongo_outbox._inbox.store import InboxStore
from mongo_outbox.errors import (
    ConfigurationError,
    DeadLettered,
    IncompatibleEventError,
    MessageIdentityError,
    PoisonMessage,
    RetryLater,
    UsageError,
    describe,
)
from mongo_outbox.events import Event, as_utc, utc_now
from mongo_outbox.settings import Backoff, Duration, check_count, check_seconds, check_timedelta
from mongo_outbox.tracing import consuming, outcome, record_failure
from mongo_outbox.upcasters import Upcasters

__all__ = [
    "DeadLetter",
    "DeadLettered",
    "Guarded",
    "Inbox",
    "Outcome",
    "Result",
    "RetryLater",
    "inbox_guard",
]

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[None]]

MAX_ID_LENGTH = 512
"""The longest message id or source accepted, in characters."""

# The inbox reads its own dates back whatever the user's client decodes them as (naive
# datetimes, or DatetimeMS with ``datetime_conversion=DATETIME_MS``), and its records as dicts.
_CODEC: CodecOptions[dict[str, Any]] = CodecOptions(
    tz_aware=True, datetime_conversion=DatetimeConversion.DATETIME
)


_INDEX_CONFLICTS = frozenset(
    {
        85,  # IndexOptionsConflict: the same keys, other options (a TTL of another length)
        86,  # IndexKeySpecsConflict: the same name, other keys or options
        11000,  # DuplicateKey: records that break the unique identity
    }
)


class Inbox:
    """Where one consumer records the messages it handled.

    Parameters:
        db: a PyMongo ``AsyncDatabase`` or a Motor database.
        consumer: this handler's name; each consumer handles each message once. Never give two
            different handlers one name: each would skip the messages the other handled.
        collection: the inbox collection's name. Which handler runs under each consumer name is
            kept in ``<collection>.handlers``.
        retention: how long records are kept (seconds or a ``timedelta``). It must exceed the
            longest delay after which the broker may redeliver a message (TTL deletes run about
            once a minute).
        transactional: ``True`` or ``False``; ``None`` asks the server whether it is a replica
            set or sharded cluster.
        processing_lease: leased mode only: how long a claim holds (seconds or a ``timedelta``)
            before another delivery may take the message over. It must exceed the handler's
            longest run.
    """

    def __init__(
        self,
        db: Any,
        *,
        consumer: str,
        collection: str = "inbox",
        retention: Duration = timedelta(days=30),
        transactional: bool | None = None,
        processing_lease: Duration = 60.0,
    ) -> None:
        for setting, value in (("Inbox.consumer", consumer), ("Inbox.collection", collection)):
            if not isinstance(value, str) or not value:
                raise ConfigurationError(
                    f"{setting} must be a non-empty str, not {value!r}", setting=setting
                )
        if transactional not in (None, True, False):
            raise ConfigurationError(
                f"Inbox.transactional must be True, False or None, not {transactional!r}",
                setting="Inbox.transactional",
            )
        self.retention = _until("Inbox.retention", retention)
        self.processing_lease = _until("Inbox.processing_lease", processing_lease)
        if transactional is not True and self.processing_lease >= self.retention:
            # A claim's record would expire while its holder runs, and a redelivery would run
            # the handler beside it. (Transactions take no lease.)
            raise ConfigurationError(
                "Inbox.processing_lease must be shorter than Inbox.retention",
                setting="Inbox.processing_lease",
            )
        self.db = db
        self.consumer = consumer
        try:
            self.collection = db.get_collection(collection, codec_options=_CODEC)
            self.handlers = db.get_collection(f"{collection}.handlers", codec_options=_CODEC)
        except InvalidName as error:
            raise ConfigurationError(
                f"Inbox.collection {collection!r} is no collection name: {error}",
                setting="Inbox.collection",
            ) from error
        self.transactional = transactional
        self._indexed = False

    async def ensure_indexes(self) -> None:
        """Create the unique identity index, the TTL index and an index of the dead letters.
        Idempotent. ``ConfigurationError`` if an index of the same keys or name but another
        definition stands in the way, or records break the identity's uniqueness: no retry
        can fix that, and the guard must not run without its unique index."""
        wanted: list[tuple[Any, dict[str, Any]]] = [
            (
                [("consumer", 1), ("source", 1), ("message_id", 1)],
                {"unique": True, "name": "identity"},
            ),
            ("expire_at", {"expireAfterSeconds": 0, "name": "ttl"}),
            # Dead letters only, for failed() and an operator's counts: no cost per message.
            (
                [("consumer", 1), ("failed_at", -1)],
                {"name": "failures", "partialFilterExpression": {"status": "failed"}},
            ),
        ]
        for keys, options in wanted:
            try:
                await self.collection.create_index(keys, **options)
            except OperationFailure as error:
                # A server that names no code (the mongoeco emulator) refused the definition.
                if error.code is not None and error.code not in _INDEX_CONFLICTS:
                    raise
                why = await self._in_the_way(_key_pattern(keys), options["name"])
                raise ConfigurationError(
                    f"inbox {self.collection.full_name}: its index {options['name']!r} cannot be "
                    f"created: {why} ({error.details.get('errmsg') if error.details else error})",
                    setting="Inbox.collection",
                ) from error
        self._indexed = True

    async def _in_the_way(self, keys: list[tuple[str, Any]], name: str) -> str:
        """What keeps index ``name`` on ``keys`` from being created: the index of those keys or
        that name with another definition, by its name, or records that break uniqueness."""
        try:
            standing = await self.collection.index_information()
        except PyMongoError:  # only the message suffers: say what it could be
            standing = {}
        for other, spec in standing.items():
            if other == name or _key_pattern(spec.get("key", [])) == keys:
                return (
                    f"the index {other!r} ({_shown(spec)}) stands in its way: drop it, or use "
                    "another Inbox.collection"
                )
        return (
            "records of one message identity twice, or an index of the same keys or name with "
            "another definition: remove the duplicates or that index, or use another "
            "Inbox.collection"
        )

    async def uses_transactions(self) -> bool:
        """Whether guarded handlers run in transactions (asks the server once if not told)."""
        if self.transactional is None:
            admin = self.db.client.admin
            try:
                hello = await admin.command("hello")
            except OperationFailure:  # servers before 4.4.2 only know the legacy name
                hello = await admin.command("isMaster")
            # Only replica set members and mongos run transactions (mongo_outbox.testing's
            # emulator reports itself a single-node replica set).
            self.transactional = "setName" in hello or hello.get("msg") == "isdbgrid"
        return self.transactional

    async def prepare(self) -> bool:
        """Create the indexes unless done already, and return ``uses_transactions()``."""
        # Without the unique index nothing would be deduplicated: never run without it.
        if not self._indexed:
            await self.ensure_indexes()
        return await self.uses_transactions()

    async def failed(
        self,
        *,
        event_type: str | None = None,
        since: datetime | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """The records of messages dead-lettered by this consumer, the latest first: each with
        its ``message_id``, ``source``, ``event_type``, the ``event``, ``attempts``,
        ``last_error`` and ``failed_at``. ``event_type`` keeps one type, ``since`` what failed
        at or after that time, ``limit`` at most that many."""
        if limit is not None:
            limit = check_count(limit, "Inbox.failed.limit")
        return await self._store().failed(event_type, _aware(since), limit)

    async def requeue(
        self,
        message_ids: Sequence[str] | None = None,
        *,
        event_type: str | None = None,
        all_failed: bool = False,
    ) -> int:
        """Give dead-lettered messages another chance: their next delivery runs the handler
        again, with a fresh set of attempts, instead of being skipped as a duplicate. The broker
        has settled them, so something must deliver them again (``mongo-outbox replay``, or
        the dead letter's own copy). Chooses the messages ``message_ids`` (of any source),
        those of ``event_type``, both (those ids of that type), or ``all_failed``. Only failed
        records change: a message that a delivery is handling is left alone. Returns how many
        were requeued."""
        if isinstance(message_ids, str):
            raise UsageError("Inbox.requeue takes a list of message ids, not one str")
        chosen = message_ids is not None or event_type is not None
        if chosen == all_failed:
            raise UsageError(
                "Inbox.requeue needs message_ids, event_type (or both), or all_failed=True alone"
            )
        return await self._store().requeue(message_ids, event_type)

    def _store(self) -> InboxStore:
        return InboxStore(self)


def _key_pattern(keys: Any) -> list[tuple[str, Any]]:
    """An index's keys as ``[(field, direction)]``, as create_index and index_information give
    them (a field name alone, a float direction from some servers)."""
    if isinstance(keys, str):
        return [(keys, 1)]
    return [
        (field, int(direction) if isinstance(direction, float) else direction)
        for field, direction in keys
    ]


def _shown(spec: dict[str, Any]) -> str:
    """An index's definition, as an operator would recognize it."""
    shown = ", ".join(
        field if direction == 1 else f"{field} {direction}"
        for field, direction in _key_pattern(spec.get("key", []))
    )
    for option in ("unique", "expireAfterSeconds", "partialFilterExpression", "sparse"):
        if spec.get(option) not in (None, False):
            shown += f", {option} {spec[option]}"
    return f"on {shown}"


def _aware(at: datetime | None) -> datetime | None:
    if at is not None and not isinstance(at, datetime):
        raise UsageError(f"since must be a datetime, not {type(at).__name__}")
    return as_utc(at) if at is not None else None


def _until(setting: str, value: Duration) -> timedelta:
    try:
        period = check_timedelta(value, setting)
        utc_now() + period  # every record's expiry is computed like this
    except OverflowError:
        raise ConfigurationError(f"{setting} is too long: {value!r}", setting=setting) from None
    return period


# -- the guard: runs a handler against an Inbox ------------------------------------------------


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
    once a message is given up on (the handler raised ``PoisonMessage``, or ``max_attempts``
    failed).
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
        _check_signature(handler)
        self.upcasters = upcasters
        self.inbox = inbox
        self.handler = handler
        self.handler_name = qualified_name(handler)
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.dead_letter = dead_letter
        self.store = InboxStore(inbox)
        metrics.inbox_started(inbox.consumer)
        self._dead_letters = metrics.InboxGauge(
            inbox.consumer, inbox.db.name, self.store.count_failed
        )
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
        self._dead_letters.delivered(result.outcome is Outcome.DEAD_LETTERED)
        return result

    async def prepare(self) -> bool:
        """What a consumer does before its first delivery: the inbox's indexes made
        (``Inbox.prepare``, whose answer it returns), and with a metrics SDK the consumer's
        metrics there at once: its outcome counters at 0 and its dead letters read from the
        inbox, so that an alert sees its first dead letter. A guard called without it makes
        the indexes at its first delivery, and its metrics appear with that delivery's."""
        transactional = await self.inbox.prepare()
        metrics.inbox_started(self.inbox.consumer)
        await self._dead_letters.first_read()
        return transactional

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
        except ConfigurationError as error:
            # Its indexes cannot be made (inbox.ensure_indexes): no message can be handled until
            # someone fixes that, and none must be lost meanwhile. Not an attempt; back at the
            # longest delay, said as an error each time. (The consumers check it at their start,
            # and refuse to start.)
            delay = check_seconds(self.backoff.maximum, "Backoff.maximum")
            log.error("inbox of %s: %s; retry in %gs", self.inbox.consumer, error, delay)
            return Result(Outcome.RETRY, 0, delay, describe(error))
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
        arrived = event
        with metrics.handler_timer(self.inbox.consumer):
            try:
                if self.upcasters is not None:
                    # The handler's copy only: the record and the dead letter keep the event
                    # as it arrived, to be read again by a later deploy.
                    event = self.upcasters.upcast(event, reader=f"consumer {self.inbox.consumer}")
                # Typed to return None; a hostile one returns a coroutine it did not await.
                handler: Callable[..., Awaitable[object]] = self.handler
                if self._wants_attempt:
                    returned = await handler(event, session, attempt=attempt)
                else:
                    returned = await handler(event, session)
                if inspect.isawaitable(returned):
                    # Its effect never ran: counted as a failure, never marked done.
                    if inspect.iscoroutine(returned):
                        returned.close()
                    raise TypeError(
                        f"the handler {self.handler_name} returned an awaitable it did not "
                        "await: its effect did not happen"
                    )
            except IncompatibleEventError as error:
                # No retry reads it before a deploy does: dead-letter it now, requeue it then.
                if (
                    event is not arrived
                    and error.event_id == event.id
                    and error.newer
                    and error.version == event.version
                ):
                    error = self._past_the_handler(arrived, event, error)
                record_failure(error)
                raise PoisonMessage(describe(error)) from error
            except Exception as error:
                record_failure(error)
                raise
            except (KeyboardInterrupt, SystemExit, GeneratorExit):
                raise
            except BaseException as error:
                if isinstance(error, asyncio.CancelledError) and _being_cancelled():
                    raise  # a stop: the message goes back, no attempt is spent
                # A CancelledError of the handler's own (a future someone else cancelled), or
                # another BaseException: a failure like any, counted. Let through, it rolled the
                # transaction back with the attempt's record, and the message came back at once,
                # for ever.
                record_failure(error)
                raise HandlerFailed(
                    f"the handler {self.handler_name} raised {describe(error)}"
                ) from error

    def _past_the_handler(
        self, arrived: Event, upcast: Event, error: IncompatibleEventError
    ) -> IncompatibleEventError:
        """The handler's own reader (``payload_as(Model)``) found the event newer than it
        because this guard's upcasters brought it there: the event as it arrived, which the
        record keeps, may be one the handler reads, and no newer producer is to blame."""
        reader = error.reader or "the handler"
        return IncompatibleEventError(
            f"event {arrived.id} ({arrived.type}) arrived as version {arrived.version}; "
            f"consumer {self.inbox.consumer}'s upcasters brought it to version "
            f"{upcast.version}, past the version {error.supported} {reader} reads: the "
            f"handler is behind its own upcasters (give {reader} version {upcast.version}, "
            "or pass the upcasters to payload_as instead of the guard: it upcasts to the "
            "model's version)",
            event_id=arrived.id,
            event_type=arrived.type,
            version=upcast.version,
            supported=error.supported,
            reader=reader,
        )


def qualified_name(handler: Callable[..., Any]) -> str:
    """``module.qualname`` of a function, of a ``partial``'s function, or of a callable
    object's class: the same handler gets the same name in every process."""
    target: Any = handler
    while isinstance(target, functools.partial):
        target = target.func
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target)
    return f"{target.__module__}.{target.__qualname__}"


def _being_cancelled() -> bool:
    """Whether the running task is being cancelled (a stop), rather than its code raising a
    CancelledError of its own; before Python 3.11 they cannot be told apart: a stop."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is None or cancelling() > 0


class HandlerFailed(Exception):
    """The handler raised a BaseException that is no stop of the process (see ``_run``)."""


def _check_signature(handler: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # no signature to read: its first call will say
        return
    try:
        if "attempt" in signature.parameters:
            signature.bind(None, None, attempt=1)
        else:
            signature.bind(None, None)
    except TypeError as error:
        raise TypeError(
            f"the handler {qualified_name(handler)} must take (event, session), and attempt= "
            f"if it names it: {error}"
        ) from None


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
