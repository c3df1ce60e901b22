"""The write side's storage seam: where an outbox keeps its entries, and what that asks of a write.

The relay reads entries through a ``Store`` (``_relay/store``); the write side writes them through a
``Layout``, one per mode, chosen once (``engine.layout_for``). Everything that differs between the
modes is the layout's:

- the fields of an aggregate document the outbox owns (a save keeps them, an update may not
  write them), and the field a relay group's partition is stored under;
- the indexes the relays and the TTL pruning need;
- which writes it can take, and the checks of the collection written to;
- how events are encoded and sized as entries, and how they are written: collection mode inserts
  them into the outbox collection in the write's own transaction (``collection_layout.py``);
  embedded mode writes them with the aggregate document, after reserving in the registry the ids
  that can collide (``embedded_layout.py``);
- its part of the document write (``documents.py`` asks for it): the fields of a new document,
  the conditions of a conditional write, the operators or pipeline stage that add the entries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Literal, Protocol

from mongo_outbox._codec import encode
from mongo_outbox._steps import Steps
from mongo_outbox._write.aggregates import encoded_size
from mongo_outbox._write.plan import Kind, Plan, Written
from mongo_outbox.events import Event

Mode = Literal["collection", "embedded"]

COUNTERS = frozenset({"_version", "_sequence"})
"""The fields every outbox owns in an aggregate document: its version and its last sequence."""

ENTRY_OVERHEAD = 32  # bytes an entry gains when stored: its sequence, its array index

DocumentWrite = Callable[[Plan, Any], Steps[Written]]
"""The write of the aggregate document (and of the entries beside it) for a plan, in a session."""


class Layout(Protocol):
    @property
    def owned(self) -> frozenset[str]:
        """The fields of an aggregate document that the outbox owns."""

    @property
    def partition_field(self) -> str:
        """Where an entry (collection mode) or a document (embedded mode) keeps its partition."""

    @property
    def entries_field(self) -> str | None:
        """The document's array of entries; None when the entries live outside it."""

    @property
    def due_field(self) -> str:
        """The document's due time, which the reads after a refused write ask for."""

    def own_transaction(self, session: Any) -> bool:
        """Whether a write in ``session`` (None: none) runs in a transaction of its own."""

    def check_supported(self, kind: Kind, name: str) -> None:
        """UsageError if this layout cannot make a write of ``kind`` to collection ``name``."""

    def check_target(self, collection: Any, session: Any) -> None:
        """InvalidAggregateError if the events written to ``collection`` would not be seen."""

    def entries(
        self,
        collection: Any,
        events: Sequence[Event],
        stamp: dict[str, Any],
        document_size: int,
    ) -> list[dict[str, Any]]:
        """The events as entries; InvalidAggregateError for sizes beyond MongoDB's."""

    def indexes(self, partitions: int) -> Steps[None]:
        """Create the indexes the relays (of ``partitions`` partitions) and the pruning need."""

    def record(self, plan: Plan, session: Any, write: DocumentWrite) -> Steps[Written]:
        """Run ``write`` for ``plan`` with what the layout needs around it."""

    def insert_entries(
        self, plan: Plan, first: int, existed: bool, now: datetime, session: Any
    ) -> Steps[None]:
        """After the document write: store the entries it did not carry, numbered from
        ``first``; ``existed``: the document was there before the write."""

    def inserted(self, plan: Plan, now: datetime) -> dict[str, Any]:
        """The fields a new document gains beside its counters."""

    def guard(self, plan: Plan) -> dict[str, Any]:
        """The conditions a conditional write of ``plan`` adds to its filter."""

    def operators(self, plan: Plan, now: datetime) -> dict[str, dict[str, Any]]:
        """The update operators an update of operators gains beside ``$inc`` of the counters."""

    def stage(self, plan: Plan, now: datetime) -> dict[str, Any]:
        """The fields the ``$set`` stage of a save or a pipeline update gains beside the
        counters."""


def encoded(
    collection: Any, events: Sequence[Event], stamp: dict[str, Any], id_key: str
) -> tuple[list[dict[str, Any]], list[int]]:
    """The events as entries (their id under ``id_key``), stamped, and each one's stored size.
    Without the caller's ``sequence``: the write numbers them (an embedded operator update
    pushed a copied event's number as it was, and the relay published it)."""
    entries = [_unnumbered(encode(e, id_key)) | stamp for e in events]
    sizes = [
        encoded_size(entry, collection, f"event {e.id}") + ENTRY_OVERHEAD
        for e, entry in zip(events, entries, strict=True)
    ]
    return entries, sizes


def _unnumbered(entry: dict[str, Any]) -> dict[str, Any]:
    entry.pop("sequence", None)
    return entry
