"""The Publisher protocol: what a relay needs from a broker adapter."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from mongo_outbox.errors import BrokerUnavailableError, InvalidEventError, describe
from mongo_outbox.events import Event


@runtime_checkable
class Publisher(Protocol):
    """Sends one event and returns once the broker has confirmed it.

    ``publish`` is called concurrently for many events (at most one per aggregate at a time),
    so an adapter keeps many messages in flight by simply not serialising its calls. It raises
    on anything short of a confirmation; the relay then retries the event later. When the broker
    cannot be reached it raises ``BrokerUnavailableError`` (an ``OSError`` or ``TimeoutError``
    does as well): such a failure does not count towards the relay's ``max_attempts``.
    """

    async def publish(self, event: Event) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class BatchPublisher(Publisher, Protocol):
    """A publisher that can pipeline a whole wave itself, cheaper than one task per event.

    ``publish_many`` sends every event before waiting for any confirmation, and returns one
    result per event, in order: ``None`` once the broker confirmed it, else the error.
    The relay uses it when a publisher has it and ``publish`` otherwise.
    """

    async def publish_many(self, events: Sequence[Event]) -> list[BaseException | None]: ...


Naming = str | Callable[[Event], str]
"""A subject or routing key: a ``str.format`` template over the event's fields
(``"events.{aggregate_type}.{type}"``), or a function of the event."""


def render(naming: Naming, event: Event) -> str:
    if callable(naming):
        return naming(event)
    # An unset field is missing, not the text "None": "events.None.placed" would be routed.
    fields = {name: value for name, value in event.__dict__.items() if value is not None}
    try:
        return naming.format_map(fields)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as error:
        raise InvalidEventError(
            f"cannot render {naming!r} for event {event.id}: {describe(error)}",
            event_id=event.id,
        ) from error


def message_headers(event: Event) -> dict[str, str]:
    """Headers every adapter sends: the event's own, then the fields consumers route on."""
    headers = dict(event.headers)
    headers["event-type"] = event.type
    if event.aggregate_type is not None:
        headers["aggregate-type"] = event.aggregate_type
    if event.aggregate_id is not None:
        headers["aggregate-id"] = str(event.aggregate_id)
    if event.sequence is not None:
        headers["sequence"] = str(event.sequence)
    return headers


def unavailable(error: BaseException) -> bool:
    """Whether a publish failed for want of a broker rather than because of its message."""
    return isinstance(error, (BrokerUnavailableError, OSError, asyncio.TimeoutError))


def unavailable_error(
    broker: str, error: BaseException, event: Event, *, destination: str | None = None
) -> BrokerUnavailableError:
    """A client's own transport error, as the one the relay does not count as an attempt
    (``destination``: the broker answered, but has nowhere to put this message)."""
    return BrokerUnavailableError(
        f"{broker}: {describe(error)}", event_id=event.id, destination=destination
    )


def closed_error(publisher: object, event: Event) -> BrokerUnavailableError:
    return BrokerUnavailableError(f"{type(publisher).__name__} is closed", event_id=event.id)


def is_async_callable(function: object) -> bool:
    """Whether calling ``function`` returns a coroutine: an ``async def`` function or method, a
    ``functools.partial`` of one, or an object whose ``__call__`` is one."""
    while isinstance(function, functools.partial):
        function = function.func
    if inspect.iscoroutinefunction(function):
        return True
    call = getattr(function, "__call__", None)  # noqa: B004 - the method itself is inspected
    return (
        call is not None and not inspect.isroutine(function) and inspect.iscoroutinefunction(call)
    )


def check_publisher(publisher: object) -> None:
    """Refuse, before anything is published, a publisher whose methods are not coroutines: a
    plain ``def publish`` would run its side effect, then fail when awaited, and be retried."""
    for name in ("publish", "aclose"):
        if not is_async_callable(getattr(publisher, name, None)):
            raise TypeError(
                f"{type(publisher).__name__}.{name} must be an async method (async def {name})"
            )
    many = getattr(publisher, "publish_many", None)
    if many is not None and not is_async_callable(many):
        raise TypeError(f"{type(publisher).__name__}.publish_many must be an async method")
