"""What makes an aggregate: its identity on the wire and a document MongoDB will store.

Consumers tell aggregates apart by ``(aggregate_type, aggregate_id)`` alone, and the relays order
and number events by that pair. So the pair must name one document and one only:

- ``aggregate_type`` is the collection's type: its name, or what ``Outbox(aggregate_types=...)``
  maps it to. The mapping is one-to-one and never takes another collection's name, so two
  collections never share a type.
- ``aggregate_id`` is the ``_id``: a str or int as it is, an ObjectId or UUID as its canonical
  string. A str ``_id`` spelled like such a canonical string would share its aggregate_id with
  the ObjectId or UUID, so it is refused.

A document is checked before anything is written: what BSON cannot encode, keys MongoDB will not
store, and a size beyond MongoDB's 16 MiB limit are refused here, not half-way through a save.
"""

from __future__ import annotations

import string
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import bson
from bson import ObjectId
from bson.errors import InvalidDocument

from mongo_outbox.errors import ConfigurationError, InvalidAggregateError
from mongo_outbox.events import AggregateId

MAX_DOCUMENT_BYTES = 16 * 1024 * 1024  # MongoDB's maxBsonObjectSize
# What the outbox adds around the entries (counters, due time, array framing): a generous bound.
_OVERHEAD_BYTES = 1024
_INT64 = 2**63
_HEX = frozenset(string.hexdigits.lower())


def type_map(mapping: Mapping[str, str] | None, collections: Iterable[str]) -> dict[str, str]:
    """``Outbox(aggregate_types=...)``, checked: non-empty names, one type per collection, and
    no type that is another collection's name (it would be that collection's default)."""
    setting = "Outbox.aggregate_types"
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise ConfigurationError(
            f"{setting} must map collection names to types, not {type(mapping).__name__}",
            setting=setting,
        )
    types = dict(mapping)
    for name, kind in types.items():
        if not (isinstance(name, str) and name and isinstance(kind, str) and kind):
            raise ConfigurationError(
                f"{setting}: {name!r}: {kind!r} is not a pair of non-empty strings",
                setting=setting,
            )
    seen: dict[str, str] = {}
    for name, kind in types.items():
        if kind in seen:
            raise ConfigurationError(
                f"{setting}: {seen[kind]} and {name} would both publish as {kind!r}",
                setting=setting,
            )
        seen[kind] = name
    names = set(types) | set(collections)
    for name, kind in types.items():
        if kind != name and kind in names:
            raise ConfigurationError(
                f"{setting}: {name} cannot publish as {kind!r}, the name of another collection",
                setting=setting,
            )
    return types


def type_of(types: Mapping[str, str], collection: str) -> str:
    """The aggregate_type of ``collection``'s events."""
    kind = types.get(collection)
    if kind is not None:
        return kind
    for other, taken in types.items():
        if taken == collection:
            raise InvalidAggregateError(
                f"{collection} cannot publish as {collection!r}: aggregate_types gives that "
                f"type to {other}; map {collection} to a type of its own",
                collection=collection,
            )
    return collection


def aggregate_id(doc_id: Any, collection: str) -> AggregateId:
    """The ``_id`` as events carry it."""
    if isinstance(doc_id, (ObjectId, uuid.UUID)):
        return str(doc_id)
    if isinstance(doc_id, int) and not isinstance(doc_id, bool):
        if not -_INT64 <= doc_id < _INT64:
            raise InvalidAggregateError(
                f"_id {doc_id} does not fit in a 64-bit integer", collection=collection
            )
        return doc_id
    if isinstance(doc_id, str):
        if _looks_like_object_id(doc_id) or _looks_like_uuid(doc_id):
            raise InvalidAggregateError(
                f"_id {doc_id!r} is a string spelled like an ObjectId or UUID, whose events "
                "would carry the same aggregate_id: store the ObjectId or UUID itself",
                collection=collection,
            )
        return doc_id
    raise InvalidAggregateError(
        f"_id of type {type(doc_id).__name__} is not supported: use a str, int, ObjectId or UUID",
        collection=collection,
    )


def _looks_like_object_id(value: str) -> bool:
    return len(value) == 24 and _HEX.issuperset(value)


def _looks_like_uuid(value: str) -> bool:
    if len(value) != 36:
        return False
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


def encoded_size(value: Mapping[str, Any], collection: Any, what: str) -> int:
    """The BSON size of ``value`` as ``collection``'s codec encodes it, or InvalidAggregateError
    for what MongoDB would refuse: keys starting with ``$`` or holding NUL, values BSON cannot
    encode (a type without a codec, an int beyond 64 bits, text that is not valid Unicode)."""
    try:
        encoded = bson.encode(value, codec_options=collection.codec_options)
    except (InvalidDocument, OverflowError, UnicodeEncodeError, TypeError, ValueError) as error:
        _check_keys(value, collection.name, what)  # the clearer reason, if it is one
        raise InvalidAggregateError(
            f"{what} cannot be stored in {collection.name}: {type(error).__name__}: {error}",
            collection=collection.name,
        ) from error
    if b"$" in encoded:  # a key can start with "$" only if the encoding holds one: rarely
        _check_keys(value, collection.name, what)
    return len(encoded)


def check_size(size: int, collection: str, what: str) -> None:
    if size + _OVERHEAD_BYTES > MAX_DOCUMENT_BYTES:
        raise InvalidAggregateError(
            f"{what} is too large: about {size} bytes, and MongoDB stores at most "
            f"{MAX_DOCUMENT_BYTES} bytes in one document",
            collection=collection,
        )


def _check_keys(value: Any, collection: str, path: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and key.startswith("$"):
                raise InvalidAggregateError(
                    f"{path}: key {key!r} cannot be stored in MongoDB", collection=collection
                )
            _check_keys(item, collection, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_keys(item, collection, f"{path}[{index}]")
