"""The write side's layouts (``mongo_outbox/_write/layout.py``) as an outbox over ``db`` with the
default settings builds them, for tests of the rules and writers without an ``Outbox``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from mongo_outbox._write.embedded_layout import EmbeddedLayout
from mongo_outbox._write.engine import layout_for
from mongo_outbox._write.event_ids import EventIds
from mongo_outbox._write.layout import Layout


def layout(db: Any, mode: str = "collection", collections: tuple[str, ...] = ("orders",)) -> Layout:
    """The layout of an outbox in ``mode`` over ``db`` whose aggregates are ``collections``."""
    registry = EventIds(db.outbox_event_ids, timedelta(days=7))
    return layout_for(mode, db, db.outbox, collections, "_outbox", registry)


def embedded(db: Any, collections: tuple[str, ...] = ("orders",)) -> EmbeddedLayout:
    """Embedded mode's layout, with what only it has (the registry's checks)."""
    return EmbeddedLayout(
        db, collections, "_outbox", EventIds(db.outbox_event_ids, timedelta(days=7))
    )
