"""The Event message: what ``save_with_events`` stores and publishers send."""

from __future__ import annotations

import builtins
import math
import os
import re
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Annotated, Any, TypeVar

import pydantic_core
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from mongo_outbox.errors import InvalidEventError
from mongo_outbox.upcasters import Upcasters, version_of

_INT64 = 2**63
_id_lock = threading.Lock()
_last_ms = 0
_counter = 0


def new_event_id() -> str:
    """A UUIDv7 string: sortable by creation time, and strictly increasing within a process."""
    global _last_ms, _counter
    with _id_lock:
        ms = time.time_ns() // 1_000_000
        if ms > _last_ms:
            _last_ms, _counter = ms, int.from_bytes(os.urandom(2), "big") & 0x3FF
        else:
            # Same millisecond (or the clock stepped back): keep ids increasing via the counter.
            _counter += 1
            if _counter > 0xFFF:
                _last_ms, _counter = _last_ms + 1, 0
        ms, counter = _last_ms, _counter
    rand = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | rand
    return str(uuid.UUID(int=value))


def utc_now() -> datetime:
    """Now, in UTC, at the millisecond precision BSON dates keep."""
    now = datetime.now(timezone.utc)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def as_utc(value: datetime) -> datetime:
    """A datetime read back from MongoDB, made aware: a client without ``tz_aware=True``
    returns naive UTC datetimes."""
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _check_text(value: str, path: str) -> None:
    # A lone surrogate is a valid Python str but not Unicode: UTF-8 (BSON, JSON) cannot carry it.
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"{path}: {value!r} is not valid Unicode ({error.reason})") from None


def _check_storable(value: Any, path: str) -> None:
    """Every str and int the Event holds outside its payload: Unicode and 64-bit, as BSON is."""
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -_INT64 <= value < _INT64:
            raise ValueError(f"{path}: {value} does not fit in a 64-bit integer")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, f"{path} key")
            _check_storable(item, f"{path}[{key!r}]")


MAX_PAYLOAD_DEPTH = 90
"""How deep a payload may nest objects and arrays: MongoDB stores documents 100 levels deep at
most, and an embedded entry puts the payload three levels down (pydantic's JSON parser, on the
consumer's side, stops at 200)."""


_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


def clean_json(value: Any, depth: int = 0, *, exact: bool = False) -> bool:
    """Whether ``value`` passes ``_check_json``, found without building the paths its errors
    name (most of its cost); with ``exact``, also whether it holds only dicts with str keys,
    lists, str, int, float, bool and None, of exactly those types (no subclass, such as bson's
    Int64), which pydantic's JsonValue validation returns as they are."""
    if depth > MAX_PAYLOAD_DEPTH:
        return False
    kind = type(value)
    if kind is str:
        return value.isascii() or _encodable(value)
    if kind is float:
        return math.isfinite(value)
    if kind is int:
        return bool(-_INT64 <= value < _INT64)
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str and (exact or not isinstance(key, str)):
                return False
            if key.startswith("$") or "\x00" in key or not (key.isascii() or _encodable(key)):
                return False
            if not clean_json(item, depth + 1, exact=exact):
                return False
        return True
    if kind is list:
        if depth == MAX_PAYLOAD_DEPTH:  # even a scalar in it is too deep
            return not value
        for item in value:
            # An int or a str inline: a list of them (ids, lines) was most of a payload's cost.
            kind = type(item)
            if kind is str:
                if not (item.isascii() or _encodable(item)):
                    return False
            elif kind is int:
                if not -_INT64 <= item < _INT64:
                    return False
            elif not clean_json(item, depth + 1, exact=exact):
                return False
        return True
    if kind in _JSON_SCALARS:
        return True
    # Another type: _check_json's own isinstance tests decide.
    return not exact and _raises_nothing(value, depth)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _raises_nothing(value: Any, depth: int) -> bool:
    try:
        _check_json(value, "payload", depth, shortcut=False)  # it called us: no way back
    except ValueError:
        return False
    return True


def _check_json(value: Any, path: str, depth: int = 0, *, shortcut: bool = True) -> None:
    # pydantic's JsonValue admits NaN, unbounded ints, lone surrogates, any key and any depth;
    # BSON and JSON peers do not.
    if shortcut and depth == 0 and clean_json(value):
        return  # the paths below are built only for an error's message
    if depth > MAX_PAYLOAD_DEPTH:
        raise ValueError(f"{path}: nested deeper than {MAX_PAYLOAD_DEPTH} levels")
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path}: {value} is not a JSON number")
    if isinstance(value, int) and not isinstance(value, bool) and not -_INT64 <= value < _INT64:
        raise ValueError(f"{path}: {value} does not fit in a 64-bit integer")
    if isinstance(value, dict):
        for key, item in value.items():
            if key.startswith("$") or "\x00" in key:
                raise ValueError(f"{path}: key {key!r} cannot be stored in MongoDB")
            _check_text(key, f"{path} key")
            _check_json(item, f"{path}.{key}", depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_json(item, f"{path}[{index}]", depth + 1)


def _dumped(value: Any) -> Any:
    """A pydantic model payload as its JSON-mode dump, which the JSON checks then see."""
    if not isinstance(value, BaseModel):
        return value
    dumped = value.model_dump(mode="json", by_alias=True)
    if not isinstance(dumped, dict):
        raise ValueError(
            f"payload: {type(value).__name__} dumps to {type(dumped).__name__}, not an object"
        )
    return dumped


def _json_object(value: dict[str, JsonValue]) -> dict[str, JsonValue]:
    _check_json(value, "payload")
    return value


def json_payload(value: Any) -> dict[str, JsonValue]:
    """``value`` as an Event's payload is stored: a model as its JSON-mode dump, checked as
    JSON; ``ValueError`` if it is no such payload. For a subclass of Event that types its
    payload: it is stored, and read back by the relay, as an Event's."""
    if isinstance(value, BaseModel):
        dumped = _dumped(value)
    else:
        try:  # a dict typed by the subclass: its datetimes, UUIDs... as pydantic writes them
            dumped = pydantic_core.to_jsonable_python(value)
        except pydantic_core.PydanticSerializationError as error:
            raise ValueError(f"payload: {error}") from None
    if not isinstance(dumped, dict):
        raise ValueError(f"payload: {type(dumped).__name__} is not an object")
    return _json_object(dumped)


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("occurred_at must be timezone-aware")
    try:
        value = value.astimezone(timezone.utc)
    except OverflowError:  # 0001-01-01 east of UTC: a ValueError, which pydantic reports
        raise ValueError(f"occurred_at {value.isoformat()} is out of range in UTC") from None
    return value.replace(microsecond=value.microsecond // 1000 * 1000)


# What every broker can carry, checked when an Event is built, so an event no broker could send
# is refused before it is stored; limits of one broker only are checked by its publisher.
SHORT_STRING_BYTES = 255
"""An AMQP short string: the longest ``message_id`` and ``correlation_id`` (in UTF-8 bytes)."""

RESERVED_HEADERS = frozenset(
    {
        # Set by every publisher from the event's own fields; consumers route on them.
        "event-type",
        "aggregate-type",
        "aggregate-id",
        "sequence",
        "content-type",  # NatsPublisher's
        # RabbitMQ routes a message to the queues named in these (sender-selected
        # distribution), and closes the channel if they are strings.
        "cc",
        "bcc",
        # RabbitMQ writes these when it dead-letters a message; consumers count retries on them.
        "x-death",
        # The delayed-message exchange holds a message back for this many milliseconds.
        "x-delay",
    }
)
"""Header names an event may not set (compared case-insensitively): the broker or the
publisher acts on them. Every name starting with one of ``RESERVED_HEADER_PREFIXES`` too."""

RESERVED_HEADER_PREFIXES = (
    "nats-",  # NATS and JetStream: Nats-Msg-Id, Nats-Rollup, Nats-Expected-*, Nats-TTL, ...
    "x-first-death-",  # RabbitMQ's dead-lettering, like x-death
    "x-last-death-",
)

# RFC 7230 token characters: what NATS headers and HTTP-style consumers accept as a name.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Control characters break a NATS header line; a tab inside a value is allowed, as in HTTP.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _text(value: str, field: str) -> str:
    # NATS clients trim a header value and cannot send a line break in it: either would change
    # what arrives, or split the header block.
    if _CONTROL.search(value):
        raise ValueError(f"{field} contains a control character: {value[:40]!r}")
    if value != value.strip(" \t"):
        raise ValueError(f"{field} starts or ends with whitespace: {value[:40]!r}")
    return value


def _identity(value: str | None, info: ValidationInfo) -> str | None:
    # id and correlation_id travel as AMQP short strings; the id also as a NATS header.
    if value is None:
        return None
    if len(value.encode()) > SHORT_STRING_BYTES:
        raise ValueError(f"{info.field_name} is longer than {SHORT_STRING_BYTES} bytes in UTF-8")
    return _text(value, str(info.field_name))


def _headers(value: dict[str, str]) -> dict[str, str]:
    seen: set[str] = set()
    for name, text in value.items():
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"header name {name[:40]!r} is not a token (RFC 7230)")
        folded = name.lower()
        if folded in RESERVED_HEADERS or folded.startswith(RESERVED_HEADER_PREFIXES):
            raise ValueError(f"header {name!r} is reserved for the broker or the publisher")
        if folded in seen:
            raise ValueError(f"header {name!r} is given twice (names ignore case)")
        seen.add(folded)
        _text(text, f"header {name!r}")
    return value


AggregateId = str | int
M = TypeVar("M", bound=BaseModel)


class Event(BaseModel):
    """A domain event, immutable once built.

    ``aggregate_type``, ``aggregate_id`` and ``sequence`` are filled in by the outbox's writes;
    ``sequence`` is the event's position in its aggregate's history, starting at 1.

    ``payload`` is a JSON object: a dict, or a pydantic model, stored as its JSON-mode dump (by
    alias), so datetimes, UUIDs, Decimals and enums become JSON by pydantic's rules;
    ``payload_as(Model)`` validates it back.

    ``version`` is the version of the payload's shape (1 unless said otherwise): ``Event.of``
    stamps the one the model declares (``event_version: ClassVar[int]``), and readers bring an
    older one up to date with ``Upcasters`` (docs/evolving-events.md).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: Annotated[str, Field(min_length=1), AfterValidator(_identity)] = Field(
        default_factory=new_event_id
    )
    type: Annotated[str, Field(min_length=1, max_length=200)]
    payload: Annotated[
        dict[str, JsonValue], BeforeValidator(_dumped), AfterValidator(_json_object)
    ] = Field(default_factory=dict)
    aggregate_type: str | None = None
    aggregate_id: AggregateId | None = None
    sequence: Annotated[int, Field(ge=1)] | None = None
    occurred_at: Annotated[datetime, AfterValidator(_utc)] = Field(default_factory=utc_now)
    headers: Annotated[dict[str, str], AfterValidator(_headers)] = Field(default_factory=dict)
    correlation_id: Annotated[str | None, AfterValidator(_identity)] = None
    causation_id: Annotated[str | None, AfterValidator(_identity)] = None
    version: Annotated[int, Field(ge=1)] = 1

    # What embedded saves did with this object (_write/event_ids.py): ``_given``, it was handed to a
    # save, so its id (even one the library made) is reserved from then on; ``_home``, the
    # document (collection's full name, _id) a save outside a transaction put it in. Copies
    # (model_copy, copy, pickle) carry both along.
    _given: bool = PrivateAttr(default=False)
    _home: tuple[str, Any] | None = PrivateAttr(default=None)
    # The id() of the object validation made: a copy (model_copy, copy, pickle) carries the
    # original's, and model_construct none, so a write checks again only what no validation
    # made (``_write/rules.py``), not every event at the cost of building it twice.
    _validated: int | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _storable(self) -> Event:
        # The payload is checked on its own; every other field must survive BSON and JSON too.
        for name, value in self.__dict__.items():
            kind = type(value)
            # The usual values need no closer look (every event the relay reads is built).
            if (
                value is None
                or kind is datetime
                or (kind is str and value.isascii())
                or (kind is int and -_INT64 <= value < _INT64)
                or name == "payload"
            ):
                continue
            _check_storable(value, name)
        if self.__pydantic_private__ is not None:
            self.__pydantic_private__["_validated"] = id(self)
        return self

    @property
    def _made_by_validation(self) -> bool:
        private = self.__pydantic_private__ or {}
        return private.get("_validated") == id(self)

    def __setstate__(self, state: dict[Any, Any]) -> None:
        super().__setstate__(state)
        if self.__pydantic_private__ is None:  # pickled by a version without private fields
            object.__setattr__(
                self, "__pydantic_private__", {"_given": False, "_home": None, "_validated": None}
            )

    def __eq__(self, other: object) -> bool:
        # Fields only: what saves did with this object is not part of the event.
        if not isinstance(other, Event):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise InvalidEventError(f"invalid event: {error}", event_id=data.get("id")) from error

    @classmethod
    def of(cls, payload: BaseModel, *, type: str, **fields: Any) -> Event:
        """An event of ``type`` whose payload is the model ``payload``, at the version the model
        declares (``event_version: ClassVar[int]``, 1 by default); ``fields`` are the other
        fields (``id``, ``headers``, ``correlation_id``, ...)."""
        if not isinstance(payload, BaseModel):
            raise InvalidEventError(
                f"Event.of takes a pydantic model, not {payload.__class__.__name__}: "
                "pass a dict as Event(type=..., payload=...)",
                event_id=fields.get("id"),
            )
        version = version_of(payload)
        if fields.setdefault("version", version) != version:
            # Two versions for one payload: the one stamped would misstate its shape.
            raise InvalidEventError(
                f"Event.of: version={fields['version']!r} is not the version "
                f"{version} that {payload.__class__.__name__} declares (event_version)",
                event_id=fields.get("id"),
            )
        return cls(type=type, payload=payload, **fields)

    def payload_as(self, model: builtins.type[M], upcasters: Upcasters | None = None) -> M:
        """The payload validated as ``model``, brought first to the model's version
        (``event_version``, 1 by default) by ``upcasters``. ``IncompatibleEventError`` if the
        event is newer than the model, or older and no upcaster reaches the model's version;
        InvalidEventError if the payload does not fit."""
        wanted = version_of(model)
        event = self
        if self.version != wanted:
            event = (upcasters or Upcasters()).upcast(
                self, wanted, reader=f"the model {model.__name__}"
            )
        try:
            # The payload is JSON (``of`` stores the JSON-mode dump), so validate it as JSON: in
            # Python mode a strict model refuses the string a UUID, datetime or Decimal dumped to,
            # and the list a tuple dumped to, though it accepts them in JSON.
            return model.model_validate_json(pydantic_core.to_json(event.payload))
        except ValidationError as error:
            raise InvalidEventError(
                f"the payload of event {self.id} ({self.type}, v{event.version}) is not a "
                f"{model.__name__}: {error}",
                event_id=self.id,
            ) from error

    @classmethod
    def from_json(cls, data: str | bytes, upcasters: Upcasters | None = None) -> Event:
        """Decode an Event from a message body, raising InvalidEventError on anything else;
        with ``upcasters``, brought to its type's latest version (``IncompatibleEventError``
        when they cannot: see ``Upcasters.upcast``).

        Top-level fields this version of Event does not know are ignored: a newer producer
        may send them, and refusing them would strand its messages in every consumer not yet
        upgraded. Building an Event (the write side) still refuses them."""
        try:
            event = cls.model_validate_json(data)
        except ValidationError as error:
            known = _known_fields(cls, data)
            if known is None:
                raise InvalidEventError(f"message body is not an Event: {error}") from error
            try:
                event = cls.model_validate_json(known)
            except ValidationError as again:
                raise InvalidEventError(f"message body is not an Event: {again}") from again
        return event if upcasters is None else upcasters.upcast(event)


def _private_defaults() -> Any:
    """Event's ``model_post_init``: what pydantic's own (``init_private_attributes``, set on a
    model with private attributes) does for Event, without the per-attribute default lookups that
    were a fifth of building one (every save builds its events, and the relay each one it reads).
    Set on the class once it is made: one defined in its body, pydantic would wrap in its own."""
    attributes = Event.__private_attributes__.items()
    defaults: dict[str, object] = {name: attribute.default for name, attribute in attributes}
    if any(attribute.default_factory is not None for _, attribute in attributes) or any(
        value is not None and type(value) is not bool for value in defaults.values()
    ):
        return None  # a default to build, or to copy: pydantic's own does it

    def model_post_init(self: Event, context: Any, /) -> None:
        if getattr(self, "__pydantic_private__", None) is None:
            object.__setattr__(self, "__pydantic_private__", defaults.copy())

    return model_post_init


_POST_INIT = _private_defaults()
if _POST_INIT is not None and Event.__pydantic_post_init__ == "model_post_init":
    Event.model_post_init = _POST_INIT  # type: ignore[method-assign]


def _known_fields(model: builtins.type[BaseModel], data: str | bytes) -> bytes | None:
    """``data`` without the top-level fields ``model`` does not know; None when it has none
    (or is no JSON object), so the first error stands. Asked only after validation failed, so
    a body without such fields is parsed once."""
    try:
        parsed = pydantic_core.from_json(data)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or parsed.keys() <= model.model_fields.keys():
        return None
    return pydantic_core.to_json({k: v for k, v in parsed.items() if k in model.model_fields})
