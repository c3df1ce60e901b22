"""The events of one write, checked and stamped as their aggregate's, and encoded as entries:
the part of the rules (``_plans.py``) that is about the events."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mongo_outbox._aggregates import aggregate_id, check_size, encoded_size, type_of
from mongo_outbox._codec import encode
from mongo_outbox.errors import InvalidEventError
from mongo_outbox.events import Event
from mongo_outbox.tracing import stamped

_ENTRY_OVERHEAD = 32  # bytes an entry gains when stored: its sequence, its array index


def stamped_events(
    events: Iterable[Event], name: str, doc_id: Any, aggregate_types: Mapping[str, str]
) -> tuple[list[Event], dict[str, Any], tuple[Event, ...]]:
    """The events, checked and carrying the current trace context (``tracing.py``), the
    stamp that makes them the aggregate ``doc_id``'s of collection ``name``, and the caller's own
    Event objects."""
    stamp: dict[str, Any] = {
        "aggregate_type": type_of(aggregate_types, name),
        "aggregate_id": aggregate_id(doc_id, name),
    }
    if isinstance(events, (str, bytes, Mapping)) or not isinstance(events, Iterable):
        raise InvalidEventError(f"events must be a list of Event, not {type(events).__name__}")
    seen: set[str] = set()
    checked = []
    for event in events:
        if not isinstance(event, Event):
            raise InvalidEventError(f"expected an Event, got {type(event).__name__}")
        if event.id in seen:
            raise InvalidEventError(f"event id {event.id} appears twice", event_id=event.id)
        seen.add(event.id)
        for key, value in stamp.items():
            given = getattr(event, key)
            if given is not None and given != value:
                raise InvalidEventError(
                    f"event {event.id} has {key} {given!r}, but {name} {doc_id!r} "
                    f"publishes as {value!r}",
                    event_id=event.id,
                )
        checked.append(event)
    # Every write API passes here: the one place events take the current trace context.
    return stamped(checked), stamp, tuple(checked)


def entries_of(
    collection: Any,
    events: list[Event],
    stamp: dict[str, Any],
    document_size: int,
    mode: str,
) -> list[dict[str, Any]]:
    """The events as stored entries; InvalidAggregateError for sizes beyond MongoDB's."""
    name = collection.name
    id_key = "id" if mode == "embedded" else "_id"
    entries = [encode(e, id_key) | stamp for e in events]
    sizes = [
        encoded_size(entry, collection, f"event {e.id}") + _ENTRY_OVERHEAD
        for e, entry in zip(events, entries, strict=True)
    ]
    if mode == "embedded":
        check_size(document_size + sum(sizes), name, "the document with its new events")
    else:
        check_size(document_size, name, "the document")
        for event, entry_size in zip(events, sizes, strict=True):
            check_size(entry_size, name, f"event {event.id}")
    return entries
