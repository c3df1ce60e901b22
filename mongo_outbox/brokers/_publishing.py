"""The Publisher protocol: what a relay needs from a broker adapter; and what the adapters share:
how a client's failure becomes the error the relay acts on, and how a URL is shown in logs.

It is the seam below the brokers' packages, which the relays publish through: users find
``Publisher`` and ``redact_url`` in the front ``mongo_outbox.publishers``."""

from __future__ import annotations

import asyncio
import functools
import re
import string
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import unquote, unquote_plus, urlsplit

from mongo_outbox._callables import is_async_callable
from mongo_outbox.errors import (
    BrokerFullError,
    BrokerUnavailableError,
    ConfigurationError,
    InvalidEventError,
    PublishError,
    describe,
)
from mongo_outbox.events import Event

T = TypeVar("T")


@runtime_checkable
class Publisher(Protocol):
    """Sends one event and returns once the broker has confirmed it.

    ``publish`` is called concurrently for many events (at most one per aggregate at a time),
    so an adapter keeps many messages in flight by simply not serialising its calls. It raises
    on anything short of a confirmation; the relay then retries the event later. What it raises
    tells the relay whose fault the failure is:

    - ``BrokerUnavailableError`` (an ``OSError`` or ``TimeoutError`` as well): the broker cannot
      be reached, is closed, or lacks what it needs (a stream, a queue, an exchange);
      ``BrokerFullError`` when it has no room. Retried without counting an attempt.
    - ``InvalidEventError``: the broker can never carry this event; the relay parks it.
    - anything else: the broker refused this message; an attempt that counts.

    ``publish`` raises ``CancelledError`` only when its own caller is cancelled.
    """

    async def publish(self, event: Event) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class WavePublisher(Publisher, Protocol):
    """A publisher that can pipeline a whole wave itself, cheaper than one task per event.

    ``publish_many`` sends every event before waiting for any confirmation, and returns one
    result per event, in order: ``None`` once the broker confirmed it, else the error.
    The relay uses it when a publisher has it and ``publish`` otherwise.
    """

    async def publish_many(self, events: Sequence[Event]) -> list[BaseException | None]: ...


BatchPublisher = WavePublisher
"""The name of before: "batch" now means nothing in a relay (docs/architecture.md, Words)."""


Naming = str | Callable[[Event], str]
"""A subject or routing key: a ``str.format`` template over the event's fields
(``"events.{aggregate_type}.{type}"``), or a function of the event."""


class NamingFailed(PublishError):
    """The naming function raised for this event. A lookup it makes may fail for a moment, so
    it is retried as any failed publish (and parked after ``max_attempts``), for this event
    alone: the others of its wave go out. What it returns that is no name is the event's own
    fault: ``InvalidEventError``, parked at once."""


def check_naming(naming: Naming, setting: str, *, empty: bool = False) -> Naming:
    """``naming`` if it can name an event: a function, or a template whose fields are the
    event's, non-empty unless ``empty`` (a RabbitMQ routing key: a fanout exchange's is "");
    ``ConfigurationError`` otherwise, before a publisher exists, rather than a refusal of
    every event it publishes (each one parked)."""
    if callable(naming):
        return naming
    if not isinstance(naming, str) or not (naming or empty):
        raise ConfigurationError(
            f"{setting} must be a non-empty str template or a function of the event, not "
            f"{naming!r}",
            setting=setting,
        )
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(naming) if field is not None]
    except ValueError as error:
        raise ConfigurationError(
            f"{setting} {naming!r} is no template: {error} (a literal brace is doubled: "
            "'{{orders}}' names '{orders}')",
            setting=setting,
        ) from None
    for field in fields:
        root = re.split(r"[.\[]", field, maxsplit=1)[0]
        if root not in Event.model_fields:
            raise ConfigurationError(
                f"{setting} {naming!r} names {{{field}}}, which is no field of an event (its "
                f"fields: {', '.join(Event.model_fields)}; a literal brace is doubled: "
                "'{{orders}}' names '{orders}')",
                setting=setting,
            )
    return naming


def render(naming: Naming, event: Event) -> str:
    if callable(naming):
        # The user's function: whatever it raises or returns is this event's fault alone, not
        # its wave's (a raise would fail every event sent beside it).
        try:
            name = naming(event)
        except Exception as error:
            raise NamingFailed(
                f"the naming function {getattr(naming, '__name__', naming)!r} failed for event "
                f"{event.id}: {describe(error)}",
                event_id=event.id,
            ) from error
        if not isinstance(name, str) or not name:
            raise InvalidEventError(
                f"the naming function {getattr(naming, '__name__', naming)!r} returned "
                f"{name!r} for event {event.id}: a subject, routing key or stream is a "
                "non-empty str",
                event_id=event.id,
            )
        return name
    # An unset field is missing, not the text "None": "events.None.placed" would be routed.
    values = event.__dict__
    roots = template_fields(naming)
    if roots is not None:
        # Only the fields the template names (two of a dozen, say): each event pays for those.
        try:
            return naming.format_map(
                {name: values[name] for name in roots if values.get(name) is not None}
            )
        except (KeyError, IndexError, AttributeError, TypeError, ValueError):
            pass  # told apart below, over all the fields
    fields = {name: value for name, value in values.items() if value is not None}
    try:
        return naming.format_map(fields)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as error:
        raise InvalidEventError(
            f"cannot render {naming!r} for event {event.id}: {describe(error)}",
            event_id=event.id,
        ) from error


@functools.lru_cache(maxsize=64)
def template_fields(naming: str) -> tuple[str, ...] | None:
    """The fields ``naming`` names (``payload`` for ``{payload[order]}``); ``None`` when it
    cannot tell: a field nested in a format spec, or no template at all."""
    try:
        parsed = list(string.Formatter().parse(naming))
    except ValueError:
        return None
    roots: list[str] = []
    for _, field, spec, _ in parsed:
        if spec and "{" in spec:
            return None
        if field is not None:
            roots.append(re.split(r"[.\[]", field, maxsplit=1)[0])
    return tuple(dict.fromkeys(roots))


def message_headers(event: Event) -> dict[str, str]:
    """Headers every adapter sends: the event's own, then the fields consumers route on (an
    event cannot set those itself: ``Event`` reserves their names)."""
    headers = dict(event.headers)
    headers["event-type"] = event.type
    if event.aggregate_type is not None:
        headers["aggregate-type"] = event.aggregate_type
    if event.aggregate_id is not None:
        headers["aggregate-id"] = str(event.aggregate_id)
    if event.sequence is not None:
        headers["sequence"] = str(event.sequence)
    return headers


def unavailable_error(
    broker: str, error: BaseException, event: Event, *, destination: str | None = None
) -> BrokerUnavailableError:
    """A client's own transport error, as the one the relay does not count as an attempt
    (``destination``: the broker answered, but has nowhere to put this message)."""
    return BrokerUnavailableError(
        f"{broker}: {describe(error)}", event_id=event.id, destination=destination
    )


def full_error(broker: str, error: BaseException, event: Event) -> BrokerFullError:
    """A broker's refusal for want of room, as the outage it is rather than the event's fault."""
    return BrokerFullError(f"{broker}: {describe(error)}", event_id=event.id)


def closed_error(publisher: object, event: Event) -> BrokerUnavailableError:
    return BrokerUnavailableError(f"{type(publisher).__name__} is closed", event_id=event.id)


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


def _retrieve(task: asyncio.Future[Any]) -> None:
    # Nobody awaits the task any more: take its outcome, so asyncio does not log it.
    if not task.cancelled():
        task.exception()


async def client_call(
    call: Awaitable[T], timeout: float, failed: Callable[[str], BaseException]
) -> T:
    """Await a broker client's call for at most ``timeout`` seconds, raising ``failed(reason)``
    when the client cancels it (as it does to what is in flight when its channel or connection
    closes) or leaves it hanging (aiormq 6 waits for ever on a write to a closed connection).
    A ``CancelledError`` propagates only when the caller itself is cancelled."""
    if sys.version_info >= (3, 11):
        caller = asyncio.current_task()
        assert caller is not None
        requested = caller.cancelling()
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                return await call
        except asyncio.CancelledError:
            if caller.cancelling() > requested:
                raise
            raise failed("the client cancelled the call (it closed)") from None
        except TimeoutError:
            if deadline.expired():
                raise failed(f"no answer within {timeout:g}s") from None
            raise
    # Python 3.10 has no Task.cancelling(): the call runs in a task of its own, so that its
    # cancellation and the caller's are told apart (asyncio.wait does not cancel it).
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(_retrieve)
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)
        raise failed(f"no answer within {timeout:g}s")
    if task.cancelled():
        raise failed("the client cancelled the call (it closed)")
    return task.result()


# scheme://userinfo@host...: the scheme as RFC 3986 spells it.
_SCHEME = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.\-]*://")
# A comma that starts the next URL of a list; other commas may be in a password.
_NEXT_URL = re.compile(r",(?=\s*[A-Za-z][A-Za-z0-9+.\-]*://)")
# A query parameter whose value is a credential, by a word in its name: MongoDB's
# tlsCertificateKeyFilePassword and authMechanismProperties (AWS_SESSION_TOKEN:...), Redis's
# password, a NATS token, and any client's secret, key or signature. Its value runs to the next
# parameter, fragment, or URL of a list.
_SECRET_WORDS = (
    r"pass(?=word|wd|phrase|[=_:]|$)|pwd|secret|token|credential|signature|apikey|api_key"
    r"|accesskey|access_key|privatekey|private_key"
)
_SECRET_PARAMETER = re.compile(
    rf"(?P<name>(?<=[?&;])[^=&;#?]*?(?:{_SECRET_WORDS}|authmechanismproperties)[^=&;#]*)"
    r"=(?P<value>(?:[^&;#,]|,(?!\s*[A-Za-z][A-Za-z0-9+.\-]*://))*)",
    re.IGNORECASE,
)
_SECRET_NAME = re.compile(_SECRET_WORDS, re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` as it may be logged or shown: ``nats://user:***@host:4222``.

    A password is replaced by ``***``, and so is a userinfo with no password, which NATS
    reads as a token (``nats://***@host``), and the value of every query parameter that holds
    a credential (``?tlsCertificateKeyFilePassword=***``, ``?authMechanismProperties=***``,
    ``?password=***``). ``url`` may be a comma-separated list of URLs (as NATS accepts), with or
    without schemes; everything but the credentials is kept.
    """
    shown, last = [], 0
    for begin, end in _secret_spans(url):
        shown += [url[last:begin], "***"]
        last = end
    return "".join([*shown, url[last:]])


def url_secrets(url: str) -> set[str]:
    """The credentials in ``url`` (see ``redact_url``), as given and percent-decoded, for a
    caller that must also keep them out of text it did not write (a client's error)."""
    found = [url[begin:end] for begin, end in _secret_spans(url)]
    for match in _SECRET_PARAMETER.finditer(url):
        if match["name"].lower() == "authmechanismproperties":
            # SERVICE_NAME:mongodb,AWS_SESSION_TOKEN:y: the token alone too, but not the
            # service name, whose every other occurrence would be garbled.
            for part in match["value"].split(","):
                key, _, secret = part.partition(":")
                if _SECRET_NAME.search(key):
                    found.append(secret)
    for server, _ in _servers(url):  # a password as a client reads it, whatever else it hides
        password = urlsplit(server.strip()).password if _SCHEME.match(server) else None
        if password:
            found.append(password)
    decoded = [unquote_plus(s) for s in found] + [unquote(s) for s in found]
    return {s for s in found + decoded if s and s != "***"}


def _secret_spans(url: str) -> list[tuple[int, int]]:
    """Where ``url``'s credentials are, merged: those found reading the query's credentials
    first and those found reading the userinfo first. Either reading alone can be fooled: a
    query value may hold an "@" (read as the end of a userinfo), and a password may hold
    "&token=" (read as a query parameter). Hiding both hides too much rather than too little."""
    query = _parameter_spans(url)
    userinfo = _userinfo_spans(url)
    spans = (
        query
        + _userinfo_spans(_blank(url, query))
        + userinfo
        + _parameter_spans(_blank(url, userinfo))
    )
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(span for span in spans if span[0] < span[1]):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def _blank(url: str, spans: list[tuple[int, int]]) -> str:
    """``url`` with ``spans`` overwritten by as many harmless characters: positions stay."""
    chars = list(url)
    for begin, end in spans:
        chars[begin:end] = "x" * (end - begin)
    return "".join(chars)


def _parameter_spans(url: str) -> list[tuple[int, int]]:
    return [(m.start("value"), m.end("value")) for m in _SECRET_PARAMETER.finditer(url)]


def _servers(url: str) -> list[tuple[str, int]]:
    """The URLs of a list, each with its offset in ``url``."""
    cuts = (
        [m.start() for m in _NEXT_URL.finditer(url)]
        if _SCHEME.match(url)
        else [n for n, char in enumerate(url) if char == ","]
    )
    starts = [0] + [cut + 1 for cut in cuts]
    ends = [*cuts, len(url)]
    return [(url[begin:end], begin) for begin, end in zip(starts, ends, strict=True)]


def _userinfo_spans(url: str) -> list[tuple[int, int]]:
    spans = []
    for server, offset in _servers(url):
        scheme = _SCHEME.match(server)
        head = scheme.end() if scheme else 0
        # A password may hold a raw "@", "/" or "?" (clients accept some of them): everything
        # up to the last "@" is taken as credentials, hiding too much rather than too little.
        userinfo, at, _ = server[head:].rpartition("@")
        if not at:
            continue
        user, colon, _ = userinfo.partition(":")
        begin = offset + head + (len(user) + 1 if colon else 0)
        spans.append((begin, offset + head + len(userinfo)))
    return spans
