"""A write with events that passed the rules (``rules.py``): the value every later step takes.

It holds what to write where, the version the write expects and the events as entries, so the
writers (``documents.py``, the layouts) and the readers of a refusal (``refusals.py``) need
nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mongo_outbox._write.updates import Update
from mongo_outbox.events import Event

Kind = Literal["save", "update", "delete", "add"]


@dataclass(frozen=True)
class Plan:
    """One write, checked: what to write where, and the version it expects."""

    kind: Kind
    collection: Any
    doc_id: Any
    events: list[Event]
    """The caller's events, checked; ``stamp`` and a sequence make them the stored ones."""
    entries: list[dict[str, Any]]
    """The events encoded as entries (id under ``id`` in embedded mode, else ``_id``), stamped."""
    stamp: dict[str, Any]
    """``aggregate_type`` and ``aggregate_id`` of the events."""
    expected_version: int | None = None
    body: dict[str, Any] = field(default_factory=dict)
    """save: the document's fields, without those the outbox owns."""
    query: dict[str, Any] = field(default_factory=dict)
    """update, delete, add: the caller's filter (it names ``_id``)."""
    update: Update | None = None
    upsert: bool = False
    array_filters: list[dict[str, Any]] | None = None
    """update: the filters of the ``$[identifier]`` positions its operators use."""
    partition: int | None = None
    """The aggregate's partition, stored with its entries when the outbox has more than one."""
    may_be_stored: tuple[str, ...] = ()
    """Embedded mode: the event ids the document may hold already (a retry, a chosen id); the
    write refuses to add them twice."""
    given: tuple[Event, ...] = ()
    """The caller's own Event objects (``events`` may be copies carrying a trace context):
    embedded mode remembers on them where they were saved (``engine.py``)."""


Written = tuple[Any, int, list[Event]]
"""A write's result: the aggregate's ``_id``, its new version, the events as stored."""
