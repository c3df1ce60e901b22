"""CloudEvents 1.0: how an Event is written as a CloudEvent, and how a CloudEvent from any
producer is read back as an Event with its inbox identity.

It is a mapping of the Event, not a second envelope: the publishers write it when given
``cloudevents=CloudEvents(source=...)``, and the consumers recognise a CloudEvent by itself
(its ``ce-`` headers or ``cloudEvents_`` properties, or the structured content type), so no
consumer setting is needed. The library needs no CloudEvents SDK for any of it.

The mapping (docs/cloudevents.md has it as a table): ``id``, ``type`` and ``time`` are the
event's ``id``, ``type`` and ``occurred_at``; ``source`` is ``CloudEvents.source``, a URI
reference naming the producer; ``subject`` is the aggregate id, as text; the data is the
payload, ``datacontenttype`` ``application/json``; the extensions ``aggregatetype``,
``sequence``, ``eventversion`` (the payload's version), ``correlationid`` and ``causationid``
carry the other fields, and ``traceparent`` and ``tracestate`` the trace context (the
distributed-tracing extension). The event's other headers travel as message headers beside the
attributes. A CloudEvent read from a message is identified in the inbox by its ``source`` and
``id`` (the pair the specification makes unique), whatever ``source`` the consumer was given.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Final, Literal
from urllib.parse import quote, urlsplit

import pydantic_core

from mongo_outbox.errors import ConfigurationError, InvalidEventError
from mongo_outbox.events import (
    _HEADER_NAME,
    RESERVED_HEADER_PREFIXES,
    RESERVED_HEADERS,
    Event,
)
from mongo_outbox.tracing import TRACE_HEADERS

__all__ = [
    "CONTENT_TYPE",
    "CloudEvents",
    "Received",
    "attributes_of",
    "read_binary",
    "read_cloudevent",
    "read_message",
    "read_structured",
    "structured_of",
]

SPECVERSION: Final = "1.0"
CONTENT_TYPE: Final = "application/cloudevents+json"
"""The structured content mode's media type (JSON event format)."""
DATA_CONTENT_TYPE: Final = "application/json"

# Attribute names as the specification allows them: lower-case ASCII letters and digits.
_NAME = re.compile(r"[a-z0-9]{1,20}")
# RFC 3986: the characters a URI reference may hold (percent-escapes included).
_URI_CHARACTERS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+")
_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
_REQUIRED = ("id", "source", "specversion", "type")
_INTEGERS = ("sequence", "eventversion")
# The attributes this mapping fills in; any other one (an extension of another producer's) is
# kept in ``Received.extensions``.
_MAPPED = frozenset(
    {
        *_REQUIRED,
        "time",
        "subject",
        "datacontenttype",
        "dataschema",
        "aggregatetype",
        *_INTEGERS,
        "correlationid",
        "causationid",
        *TRACE_HEADERS,
    }
)

# Header prefixes of binary mode: the NATS and HTTP bindings' ``ce-``, Kafka's ``ce_``, and
# the AMQP binding's ``cloudEvents_`` (and the older ``cloudEvents:``) for RabbitMQ. Reading
# accepts each one on any broker: RabbitMQ producers use ``ce-`` too (knative's binding).
BINARY_PREFIXES: Final = ("ce-", "ce_", "cloudevents_", "cloudevents:")

# The HTTP binding (3.1.3.2), and the NATS binding that follows it, percent-encode a ``ce-``
# header's value: the UTF-8 bytes of a space, a double quote, a percent sign and any character
# outside printable ASCII (U+0021-U+007E) as %XX; a receiver decodes once. Kafka's ``ce_`` and
# AMQP's ``cloudEvents_`` values go as they are (those bindings carry UTF-8 strings or AMQP
# types), and so do knative's RabbitMQ ``ce-`` headers.
PERCENT_ENCODED_PREFIX: Final = "ce-"
_HEADER_SAFE: Final = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')
# _HEADER_SAFE's characters: most values are only those, and skip quote(), which costs more.
_HEADER_PLAIN = re.compile(r"[!#$&-~]*")
_ESCAPES = re.compile(r"(?:%[0-9A-Fa-f]{2})+")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"', re.DOTALL)
_QUOTED_PAIR = re.compile(r"\\(.)", re.DOTALL)


def check_source(source: object, setting: str = "CloudEvents.source") -> str:
    """``source`` if it is a non-empty URI reference (RFC 3986); ``ConfigurationError``
    otherwise."""
    if not isinstance(source, str) or not source:
        raise ConfigurationError(
            f"{setting} must be a non-empty URI reference, not {source!r}", setting=setting
        )
    problem = _uri_problem(source)
    if problem:
        raise ConfigurationError(
            f"{setting} {source[:80]!r} is not a URI reference (RFC 3986): {problem}",
            setting=setting,
        )
    return source


def _uri_problem(text: str) -> str | None:
    if not _URI_CHARACTERS.fullmatch(text):
        bad = next(c for c in text if not _URI_CHARACTERS.fullmatch(c))
        return f"{bad!r} may not appear in one unescaped (percent-encode it)"
    if _PERCENT.search(text):
        return "a '%' not followed by two hex digits"
    try:
        urlsplit(text)
    except ValueError as error:  # a bracketed host that is no IPv6 address
        return str(error)
    return None


@dataclass(frozen=True)
class CloudEvents:
    """Publish events as CloudEvents 1.0.

    Parameters:
        source: the ``source`` attribute, a URI reference naming this producer
            (``"/orders"``, ``"urn:example:orders"``, ``"https://example.com/orders"``).
        mode: ``"binary"`` (the attributes as message headers, the payload as the body) or
            ``"structured"`` (one ``application/cloudevents+json`` document as the body).
    """

    source: str
    mode: Literal["binary", "structured"] = "binary"

    def __post_init__(self) -> None:
        check_source(self.source)
        if self.mode not in ("binary", "structured"):
            raise ConfigurationError(
                f"CloudEvents.mode must be 'binary' or 'structured', not {self.mode!r}",
                setting="CloudEvents.mode",
            )


def check_option(value: object, setting: str) -> CloudEvents | None:
    """A publisher's ``cloudevents`` setting: a ``CloudEvents`` or ``None``."""
    if value is not None and not isinstance(value, CloudEvents):
        raise ConfigurationError(
            f"{setting} must be a CloudEvents(source=...) or None, not {value!r}", setting=setting
        )
    return value


def message_of(
    event: Event, config: CloudEvents | None, prefix: str, headers: dict[str, str]
) -> tuple[dict[str, str], str, bytes]:
    """The headers, content type and body of ``event``'s message as ``config`` says, given the
    headers a publisher sends without CloudEvents (``headers``: the event's own and the routing
    ones, which stay: an ordered consumer keys on ``aggregate-id``). Without ``config``, the
    event's own JSON; binary mode adds the attributes under ``prefix`` and moves the trace
    context into them, percent-encoded under ``ce-`` (``PERCENT_ENCODED_PREFIX``; earlier
    versions wrote them as they were, and an SDK reading one that held ``%XX`` decoded it)."""
    if config is None:
        if type(event) is Event:
            # An Event holds plain values, which pydantic_core writes as model_dump_json does,
            # byte for byte, at a tenth of the cost (its JsonValue payload is serialised by
            # inference either way): every message the relay sends is one. Only the fields, in
            # their order (model_copy(update=...) can leave other keys in __dict__); a subclass
            # may serialise fields of its own. A __dict__ of as many keys holds just the fields,
            # in their order (pydantic fills it so).
            values = event.__dict__
            if len(values) != len(_EVENT_FIELDS):
                values = {name: values[name] for name in _EVENT_FIELDS}
            return headers, "application/json", pydantic_core.to_json(values, inf_nan_mode="null")
        return headers, "application/json", event.model_dump_json().encode()
    check_headers(event)
    if config.mode == "structured":
        return headers, CONTENT_TYPE, structured_of(event, config.source)
    binary = {name: value for name, value in headers.items() if name.lower() not in TRACE_HEADERS}
    encode = prefix == PERCENT_ENCODED_PREFIX
    for name, value in attributes_of(event, config.source).items():
        if name != "datacontenttype":  # the message's own content type
            text = str(value)
            if encode and not _HEADER_PLAIN.fullmatch(text):
                text = quote(text, safe=_HEADER_SAFE)
            binary[prefix + name] = text
    return binary, DATA_CONTENT_TYPE, pydantic_core.to_json(event.payload, inf_nan_mode="null")


_EVENT_FIELDS = tuple(Event.model_fields)


def _time(at: datetime) -> str:
    return at.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def attributes_of(event: Event, source: str) -> dict[str, str | int]:
    """``event``'s context attributes (see the module's table); the integers are ``int``."""
    attributes: dict[str, str | int] = {
        "specversion": SPECVERSION,
        "id": event.id,
        "source": source,
        "type": event.type,
        "time": _time(event.occurred_at),
        "datacontenttype": DATA_CONTENT_TYPE,
        "eventversion": event.version,
    }
    if event.aggregate_id is not None:
        attributes["subject"] = str(event.aggregate_id)
    if event.aggregate_type is not None:
        attributes["aggregatetype"] = event.aggregate_type
    if event.sequence is not None:
        attributes["sequence"] = event.sequence
    if event.correlation_id is not None:
        attributes["correlationid"] = event.correlation_id
    if event.causation_id is not None:
        attributes["causationid"] = event.causation_id
    for name, value in event.headers.items():
        if name.lower() in TRACE_HEADERS:
            attributes[name.lower()] = value
    return attributes


def structured_of(event: Event, source: str) -> bytes:
    """``event`` as one ``application/cloudevents+json`` document."""
    document: dict[str, Any] = dict(attributes_of(event, source))
    document["data"] = event.payload
    return pydantic_core.to_json(document, inf_nan_mode="null")


def check_headers(event: Event) -> None:
    """Refuse an event whose own header names would read as CloudEvents attributes."""
    for name in event.headers:
        if name.lower().startswith(BINARY_PREFIXES):
            raise InvalidEventError(
                f"event {event.id}: header {name!r} would read as a CloudEvents attribute; "
                "rename it (the CloudEvents mapping writes those itself)",
                event_id=event.id,
            )


@dataclass(frozen=True)
class Received:
    """A CloudEvent read from a message: the Event it maps to and its inbox identity.

    Pass it to a guard as ``await guarded(received.event, message_id=received.id,
    source=received.source)``; the consumer helpers do that themselves.
    """

    event: Event
    source: str
    extensions: Mapping[str, Any]
    """Attributes of the CloudEvent that the mapping does not use (another producer's)."""

    @property
    def id(self) -> str:
        return self.event.id


def _attribute_text(name: str, value: Any, event_id: str | None) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            value = None
    if name == "time":
        # The AMQP binding's native timestamp: a datetime as aio-pika decodes one, or the
        # milliseconds since the epoch the SDK writes (receivers must accept both).
        if isinstance(value, datetime):
            return _time(value if value.tzinfo else value.replace(tzinfo=timezone.utc))
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return _time(datetime.fromtimestamp(value / 1000, timezone.utc))
            except (OverflowError, OSError, ValueError):
                pass  # refused below as no timestamp
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidEventError(
            f"CloudEvent {event_id}: attribute {name!r} is {type(value).__name__}, not a string",
            event_id=event_id,
        )
    return str(value)


def read_cloudevent(
    attributes: Mapping[str, Any], data: Any, *, headers: Mapping[str, Any] | None = None
) -> Received:
    """The Event a CloudEvent maps to, from its attributes and its data (a JSON object, as
    ``dict``, or as its JSON text or bytes); ``headers``: the message's other headers, kept as
    the event's. ``InvalidEventError`` names what is missing or wrong."""
    raw_id = attributes.get("id")
    event_id = raw_id if isinstance(raw_id, str) else None
    missing = [name for name in _REQUIRED if attributes.get(name) in (None, "")]
    if missing:
        raise InvalidEventError(
            f"CloudEvent {event_id or '(no id)'} lacks the required attribute(s) "
            f"{', '.join(missing)}",
            event_id=event_id,
        )
    # Only the attributes the mapping reads must be text; another producer's extensions may be
    # of any CloudEvents type (an AMQP boolean, an integer) and are handed on as they came.
    text = {
        name: _attribute_text(name, value, event_id)
        for name, value in attributes.items()
        if value is not None and name in _MAPPED
    }
    if text["specversion"] != SPECVERSION:
        raise InvalidEventError(
            f"CloudEvent {event_id}: specversion {text['specversion']!r} is not 1.0",
            event_id=event_id,
        )
    problem = _uri_problem(text["source"])
    if problem:
        raise InvalidEventError(
            f"CloudEvent {event_id}: source {text['source'][:80]!r} is not a URI reference: "
            f"{problem}",
            event_id=event_id,
        )
    content_type = text.get("datacontenttype", DATA_CONTENT_TYPE)
    media = content_type.split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise InvalidEventError(
            f"CloudEvent {event_id}: datacontenttype {content_type!r} is not JSON; an Event's "
            "payload is a JSON object",
            event_id=event_id,
        )
    payload = _payload(data, event_id)
    fields: dict[str, Any] = {
        "id": text["id"],
        "type": text["type"],
        "payload": payload,
        "headers": _headers(headers or {}) | {n: text[n] for n in TRACE_HEADERS if n in text},
    }
    if "time" in text:
        fields["occurred_at"] = _parse_time(text["time"], event_id)
    for attribute, field in (
        ("subject", "aggregate_id"),
        ("aggregatetype", "aggregate_type"),
        ("correlationid", "correlation_id"),
        ("causationid", "causation_id"),
    ):
        if attribute in text:
            fields[field] = text[attribute]
    for attribute, field in (("sequence", "sequence"), ("eventversion", "version")):
        if attribute in text:
            try:
                fields[field] = int(text[attribute])
            except ValueError:
                raise InvalidEventError(
                    f"CloudEvent {event_id}: {attribute} {text[attribute]!r} is not an integer",
                    event_id=event_id,
                ) from None
    try:
        event = Event(**fields)
    except InvalidEventError as error:
        raise InvalidEventError(
            f"CloudEvent {event_id} maps to no Event: {error}", event_id=event_id
        ) from error
    extensions = {k: v for k, v in attributes.items() if k not in _MAPPED}
    return Received(event=event, source=text["source"], extensions=extensions)


def _payload(data: Any, event_id: str | None) -> Any:
    if isinstance(data, (str, bytes, bytearray)):
        try:
            data = pydantic_core.from_json(data)
        except ValueError as error:
            raise InvalidEventError(
                f"CloudEvent {event_id}: its data is not JSON: {error}", event_id=event_id
            ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidEventError(
            f"CloudEvent {event_id}: its data is {type(data).__name__}, not a JSON object, "
            "which an Event's payload is",
            event_id=event_id,
        )
    return data


# RFC 3339's date-time: any number of fraction digits (Go writes nanoseconds), "Z" or an offset.
# Parsed here rather than by datetime.fromisoformat, which on Python 3.10 takes 3 or 6 digits only.
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)


def _parse_time(value: str, event_id: str | None) -> datetime:
    match = _RFC3339.fullmatch(value)
    try:
        if match is None:
            raise ValueError(value)
        year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
        micro = int((match[7] or "0")[:6].ljust(6, "0"))
        offset = timedelta(0)
        if match[9]:
            offset = timedelta(hours=int(match[10]), minutes=int(match[11]))
            offset = -offset if match[9] == "-" else offset
        # RFC 3339 allows a leap second (:60); datetime has none, so it is the next second's start.
        leap = second == 60
        at = datetime(
            year, month, day, hour, minute, 59 if leap else second, micro, timezone(offset)
        )
        return at + timedelta(seconds=1) if leap else at
    except (ValueError, OverflowError):
        raise InvalidEventError(
            f"CloudEvent {event_id}: time {value!r} is not an RFC 3339 timestamp",
            event_id=event_id,
        ) from None


def _headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """The message headers that are the event's own: text, not the broker's, the publisher's
    or a CloudEvents attribute. A header an Event cannot hold (a name that is no token, one
    given twice in another case, a value with a control character) is left out rather than
    making another producer's whole message unreadable."""
    own: dict[str, str] = {}
    seen: set[str] = set()
    for name, value in headers.items():
        folded = name.lower()
        if (
            not isinstance(name, str)
            or not _HEADER_NAME.fullmatch(name)
            or folded in seen
            or folded in RESERVED_HEADERS
            or folded.startswith(RESERVED_HEADER_PREFIXES)
            or folded.startswith(BINARY_PREFIXES)
            or folded.startswith("x-")  # RabbitMQ's and the retry queues' bookkeeping
            or folded in TRACE_HEADERS
        ):
            continue
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        if isinstance(value, str) and value == value.strip(" \t") and value.isprintable():
            own[name] = value
            seen.add(folded)
    return own


def read_structured(body: bytes | str, *, headers: Mapping[str, Any] | None = None) -> Received:
    """A structured-mode message's CloudEvent (``application/cloudevents+json``)."""
    try:
        document = pydantic_core.from_json(body)
    except ValueError as error:
        raise InvalidEventError(f"CloudEvent body is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise InvalidEventError("CloudEvent body is not a JSON object")
    if "data_base64" in document:
        raise InvalidEventError(
            f"CloudEvent {document.get('id')}: data_base64 (binary data) is no JSON payload",
            event_id=document.get("id") if isinstance(document.get("id"), str) else None,
        )
    data = document.pop("data", None)
    return read_cloudevent(document, data, headers=headers)


def read_binary(
    headers: Mapping[str, Any],
    body: bytes,
    *,
    content_type: str | None = None,
    percent_encoded: bool = True,
) -> Received:
    """A binary-mode message's CloudEvent: its attributes from the headers of any binding's
    prefix (``ce-``, ``ce_``, ``cloudEvents_``, ``cloudEvents:``), ``datacontenttype`` from
    ``content_type`` (the message's), the data from the body.

    ``ce-`` values are percent-decoded, as the HTTP and NATS bindings write them
    (``PERCENT_ENCODED_PREFIX``), unless ``percent_encoded`` is false: knative's RabbitMQ binding
    writes its ``ce-`` values as they are. A value this library wrote before it encoded them
    reads the same unless it held ``%`` and two hex digits, which now read decoded."""
    attributes: dict[str, Any] = {}
    others: dict[str, Any] = {}
    for name, value in headers.items():
        folded = name.lower()
        prefix = next((p for p in BINARY_PREFIXES if folded.startswith(p)), None)
        if prefix is None:
            if folded != "content-type":
                others[name] = value
            continue
        attribute = folded[len(prefix) :]
        if _NAME.fullmatch(attribute):
            if percent_encoded and prefix == PERCENT_ENCODED_PREFIX:
                value = _percent_decoded(name, value)
            attributes[attribute] = value
    if content_type is not None:
        attributes["datacontenttype"] = content_type
    return read_cloudevent(attributes, body, headers=others)


def _percent_decoded(header: str, value: Any) -> Any:
    """A ``ce-`` header's value as the HTTP binding (3.1.3.2) decodes one: a value that is one
    quoted string (RFC 7230, 3.2.6, which older versions of the binding let a sender write)
    unquoted, then one round of percent-decoding. Escapes that are no UTF-8 are refused, as the
    binding says; a ``%`` without two hex digits after it is left as it is, so that a value
    written unencoded reads as it was."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode()
        except UnicodeDecodeError:
            return value  # refused by read_cloudevent as no string, if the mapping reads it
    if not isinstance(value, str):
        return value
    quoted = _QUOTED.fullmatch(value)
    if quoted:
        value = _QUOTED_PAIR.sub(r"\1", quoted[1])
    try:
        return _ESCAPES.sub(lambda run: bytes.fromhex(run[0].replace("%", "")).decode(), value)
    except UnicodeDecodeError:
        raise InvalidEventError(
            f"CloudEvent header {header!r}: {value[:80]!r} percent-encodes no UTF-8 text"
        ) from None


def is_cloudevent(headers: Mapping[str, Any], content_type: str | None) -> bool:
    """Whether a message is a CloudEvent: structured by its content type, binary by a
    ``specversion`` header under a binding's prefix."""
    if content_type is not None and _structured(content_type):
        return True
    return any(name.lower() in _SPECVERSION_HEADERS for name in headers)


_SPECVERSION_HEADERS = frozenset(prefix + "specversion" for prefix in BINARY_PREFIXES)


def _structured(content_type: str) -> bool:
    return content_type.split(";")[0].strip().lower() == CONTENT_TYPE


def read_message(
    headers: Mapping[str, Any],
    body: bytes,
    *,
    content_type: str | None = None,
    percent_encoded: bool = True,
) -> Received:
    """A message's CloudEvent, in either mode; ``InvalidEventError`` if it is none.
    ``percent_encoded``: as ``read_binary`` takes it."""
    if content_type is not None and _structured(content_type):
        return read_structured(body, headers=headers)
    return read_binary(headers, body, content_type=content_type, percent_encoded=percent_encoded)
