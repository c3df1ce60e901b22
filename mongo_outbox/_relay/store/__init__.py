"""The relay's storage seam, one implementation per outbox mode: the protocol and the values it
trades in are in ``base`` (a leaf both stores import), the stores in ``collection`` and
``embedded``. This face picks the store for an outbox, so the choice of mode is made once."""

from __future__ import annotations

from mongo_outbox._relay.store.base import Store
from mongo_outbox._relay.store.collection import CollectionStore
from mongo_outbox._relay.store.embedded import EmbeddedStore
from mongo_outbox.outbox import Outbox


def store_for(outbox: Outbox, partition: int | None = None, relay: str | None = None) -> Store:
    """The store of ``outbox``; with ``partition``, one that claims, wakes and counts that
    partition's entries only (a relay group member's view). ``relay`` names the relay whose
    publishes and parks it records (``published_by``, ``parked_by``)."""
    if outbox.mode == "embedded":
        return EmbeddedStore(outbox, partition, relay)
    return CollectionStore(outbox, partition, relay)
