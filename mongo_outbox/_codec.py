"""How an Event is stored as an outbox entry and read back, in both modes: one place, so the
write side and the relay cannot drift apart.

An entry is the Event's fields with its id under ``_id`` (a document of the outbox collection)
or ``id`` (an element of an aggregate's outbox array), without the optional ones that hold their
default, plus the relay's bookkeeping fields, which decoding ignores. An embedded entry appended
by an update of operators carries no ``sequence``: an operator update cannot read the stored
``_sequence`` it moves, so ``numbered`` gives the entry its number when the entries are read
(see ``numbered`` for why the position tells it). Reading goes through collections with codec
options of our own, so a client configured for naive datetimes or ``DATETIME_MS`` reads the
same entries.
"""

from __future__ import annotations

import math
from copy import copy
from datetime import datetime, timezone, tzinfo
from decimal import Decimal
from typing import Any

from bson.codec_options import DatetimeConversion
from bson.decimal128 import Decimal128
from pydantic import ValidationError

from mongo_outbox.errors import InvalidEventError, describe
from mongo_outbox.events import Event, as_utc, clean_json, json_payload

_EVENT_FIELDS = frozenset(Event.model_fields)
_INT64 = 2**63
_EXACT_DOUBLES = 2**53
_EVENT_FIELDS_IN_ORDER = tuple(Event.model_fields)


# Left out of an entry while they hold their default (decoding restores it): every write and
# every read of an embedded document carries its entries, so bytes saved are saved each time.
_DEFAULTS: dict[str, Any] = {
    "sequence": None,
    "headers": {},
    "correlation_id": None,
    "causation_id": None,
}


def encode(event: Event, id_key: str) -> dict[str, Any]:
    if type(event) is Event:
        # An Event is frozen and holds plain values (its payload is validated JSON), so its
        # fields are what model_dump() returns, at a third of the cost: every write encodes its
        # events. Only the fields: model_copy(update=...) can leave other keys beside them. A
        # subclass may hold models of its own, which only model_dump() turns into documents.
        values = event.__dict__
        data = {name: values[name] for name in _EVENT_FIELDS_IN_ORDER}
    else:
        data = event.model_dump()
        if data.keys() != _EVENT_FIELDS:
            # The relay reads entries back as Event: other keys would never be sent (computed
            # fields, extras, a serializer of its own), and missing ones would not decode.
            raise InvalidEventError(
                f"{type(event).__name__} dumps {sorted(data.keys() ^ _EVENT_FIELDS)} beside or "
                "instead of the fields of Event, which is what a broker receives: put such data "
                "in the payload",
                event_id=event.id,
            )
        try:
            # A subclass may type its payload (a model, datetimes): stored as an Event's is,
            # its JSON-mode dump, or the relay would read back a payload no Event takes.
            data["payload"] = json_payload(event.payload)
        except ValueError as error:
            raise InvalidEventError(
                f"the payload of {type(event).__name__} {event.id} is no Event payload: {error}",
                event_id=event.id,
            ) from None
    data[id_key] = data.pop("id")
    for key, default in _DEFAULTS.items():
        if data[key] == default:
            del data[key]
    return data


def shown(entry: dict[str, Any]) -> dict[str, Any]:
    """A stored entry with every field the Event has, as listings show it (``parked()``)."""
    return {key: copy(default) for key, default in _DEFAULTS.items()} | entry


def decode(entry: dict[str, Any], id_key: str) -> Event:
    """The Event an entry holds; InvalidEventError for an entry this version cannot read (from
    another producer, a manual fix, an older schema), so the relay can park it."""
    data = {k: v for k, v in entry.items() if k in _EVENT_FIELDS}
    data["id"] = entry.get(id_key)
    at = data.get("occurred_at")
    if isinstance(at, datetime):
        data["occurred_at"] = as_utc(at)
    # A pipeline write numbers entries from the stored _sequence, in its BSON type; an entry
    # without a whole number from 1 (its document's _sequence was none, or too small for its
    # entries) cannot be put in order.
    sequence = counter(data.get("sequence"))
    if sequence is None or sequence < 1:
        raise InvalidEventError(
            f"outbox entry {data['id']!r} has no sequence to publish it in order by (a whole "
            f"number from 1): {data.get('sequence')!r}; is its document's _sequence right?",
            event_id=data["id"] if isinstance(data["id"], str) else None,
        )
    data["sequence"] = sequence
    payload = data.get("payload")
    if type(payload) is dict and clean_json(payload, exact=True):
        # Every entry the relay claims is decoded, and pydantic's JsonValue validation was
        # two thirds of that. A payload of JSON's own types only comes out of it as it went
        # in, and clean_json applies the payload's own rules (_check_json), so the rest of the
        # event is validated without it; anything else, or an entry whose other fields are
        # refused, goes through the whole validation, which tells what is wrong.
        data["payload"] = {}
        try:
            # Through __init__: model_validate of a model with an __init__ of its own runs
            # the whole validation twice.
            event = Event(**data)
        except (InvalidEventError, ValueError, TypeError):
            data["payload"] = payload
        else:
            event.__dict__["payload"] = payload
            return event
    try:
        return Event.model_validate(data)
    except (ValidationError, ValueError, TypeError) as error:
        raise InvalidEventError(
            f"outbox entry {data['id']!r} cannot be read: {describe(error)}",
            event_id=data["id"] if isinstance(data["id"], str) else None,
        ) from error


def ours(collection: Any, *, tzinfo: tzinfo | None = timezone.utc) -> Any:
    """``collection`` read as dicts with aware UTC datetimes whatever its client's codec
    options (a client of ``RawBSONDocument`` had every entry parked); dates outside datetime's
    range come back as ``DatetimeMS`` (and such an entry fails to decode) instead of breaking
    the whole read. ``tzinfo=None`` keeps bson's own UTC tzinfo (``read_for_relay``)."""
    options = collection.codec_options.with_options(
        document_class=dict,
        tz_aware=True,
        tzinfo=tzinfo,
        datetime_conversion=DatetimeConversion.DATETIME_AUTO,
    )
    return collection.with_options(codec_options=options)


def read_for_relay(collection: Any) -> Any:
    """``ours(collection)``, except that its datetimes carry bson's own UTC tzinfo rather than
    ``timezone.utc``: the same instants, read at two thirds of the cost (bson asks a given
    tzinfo for its offsets and converts each date to it), for the reads of whole entries a
    claim makes. ``decode`` gives ``occurred_at`` in ``timezone.utc`` all the same."""
    return ours(collection, tzinfo=None)


def counter(value: Any) -> int | None:
    """A stored ``_version``, ``_sequence`` or entry ``sequence`` as an int; None when it is no
    whole number from 0 to 2**63 - 1 (or missing). Documents written by other code may hold a
    counter as a double, an Int64 or a Decimal128, and ``$inc`` keeps the type it finds; a double
    from 2**53 up no longer moves by 1, so it counts as no whole number."""
    if value is None:  # most counters of most entries: never stored
        return None
    if type(value) is int:
        return value if 0 <= value < _INT64 else None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        number = int(value)  # an Int64 too
    elif isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer() and abs(value) < _EXACT_DOUBLES):
            return None
        number = int(value)
    elif isinstance(value, (Decimal128, Decimal)):  # a Decimal: a codec that decodes Decimal128
        exact = value.to_decimal() if isinstance(value, Decimal128) else value
        if not (exact.is_finite() and exact == exact.to_integral_value()):
            return None
        number = int(exact)
    else:
        return None
    return number if 0 <= number < _INT64 else None


def numbered(entries: list[Any], last: Any) -> list[Any]:
    """An aggregate document's outbox array with every entry's ``sequence``; ``last`` is the
    document's ``_sequence``, read with the array.

    An entry without one takes ``last`` minus the number of entries after it. That holds because
    each write appends its entries at the end and moves ``_sequence`` by as many, in one
    single-document write, and no entry after an unnumbered one is ever removed: the relay
    removes only entries it published, which follow in order every earlier entry it did not
    park, and a parked entry keeps its place (``EmbeddedStore.settle`` writes its number too;
    an unreadable one is wrapped where it is, and a requeue unwraps it there).
    """
    last = counter(last)
    if last is None:
        return list(entries)
    after = len(entries) - 1
    out: list[Any] = []
    for index, entry in enumerate(entries):
        if isinstance(entry, dict) and "id" in entry and entry.get("sequence") is None:
            entry = entry | {"sequence": last - (after - index)}
        out.append(entry)
    return out
