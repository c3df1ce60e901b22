"""The event-id registry of embedded mode: one event id, one aggregate document.

In collection mode the outbox collection's ``_id`` is the event id, so a reused id fails its
insert. In embedded mode the entries live in many documents and nothing stops two of them from
holding the same id; the broker would then drop the second as a duplicate of the first and the
relay mark both published, losing the second without a word. So each embedded save first
reserves its event ids here, ``{_id: event id, collection, aggregate: the document's _id,
expire_at}``, with one insert, and writes the document only once every id is its own.

Why two writes lose nothing:

- A crash after the reservation and before the document write leaves a reservation and no event.
  A retry of that save (same collection, same document) finds its own reservation and goes on;
  otherwise the reservation simply expires.
- A reservation outlives its entry: the relay prunes a published entry from its document at once,
  but the reservation is kept ``retention`` from the save, like a published entry of collection
  mode, so an id published a moment ago cannot be reused by another document either. (Only an
  entry still pending ``retention`` after its save outlives its reservation.)
- A save that fails after reserving (a version conflict, a document too large) removes the
  reservations it made, so a refused save writes nothing.

A save inside a transaction reads the registry first and inserts only the missing ids: a
duplicate key would abort the caller's transaction, and the transaction makes the reservation and
the document write one.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from pymongo.errors import BulkWriteError

from mongo_outbox._driver import DUPLICATE_KEY
from mongo_outbox._refusals import write_errors
from mongo_outbox._steps import Steps, call, listing
from mongo_outbox.errors import DuplicateEventError
from mongo_outbox.events import utc_now

_ATTEMPTS = 3  # a reservation that expires between our insert and our read is tried again


class EventIds:
    """The registry collection ``registry`` of an embedded outbox."""

    def __init__(self, registry: Any, retention: timedelta) -> None:
        self.registry = registry
        self.retention = retention

    def ensure_index(self) -> Steps[None]:
        yield call(self.registry, "create_index", "expire_at", expireAfterSeconds=0, name="ttl")

    def reserve(
        self, ids: Sequence[str], collection: str, doc_id: Any, session: Any
    ) -> Steps[list[str]]:
        """Reserve ``ids`` for the document ``doc_id`` of ``collection``; return the ids this call
        reserved (not those a crashed earlier save of the same document had). Raises
        DuplicateEventError, having reserved nothing, if an id belongs to another document."""
        if not ids:
            return []
        if session is not None and session.in_transaction:
            mine = yield from self._owned(list(ids), collection, doc_id, session, [])
            missing = [i for i in ids if i not in mine]
            try:
                yield from self._insert(missing, collection, doc_id, session)
            except BulkWriteError as error:
                # A concurrent save took the id since our read; the transaction is aborted.
                raise _duplicate(error, collection) from error
            return missing
        reserved: list[str] = []
        wanted = list(ids)
        for _ in range(_ATTEMPTS):
            try:
                yield from self._insert(wanted, collection, doc_id, session)
                return reserved + wanted
            except BulkWriteError as error:
                failed = {wanted[e["index"]]: e.get("code") for e in write_errors(error)}
                reserved += [i for i in wanted if i not in failed]
                if any(code != DUPLICATE_KEY for code in failed.values()):
                    yield from self.release(reserved, collection, doc_id, session)
                    raise error
                mine = yield from self._owned(list(failed), collection, doc_id, session, reserved)
                # Whatever is neither ours nor another's expired since the insert: try again.
                wanted = [i for i in failed if i not in mine]
            if not wanted:
                return reserved
        yield from self.release(reserved, collection, doc_id, session)
        raise DuplicateEventError(
            f"event ids {wanted} kept colliding in {self.registry.name}", collection=collection
        )

    def release(
        self, ids: Sequence[str], collection: str, doc_id: Any, session: Any
    ) -> Steps[None]:
        """Remove reservations ``reserve`` made, when the document write wrote nothing."""
        if ids:
            yield call(
                self.registry,
                "delete_many",
                {"_id": {"$in": list(ids)}, "collection": collection, "aggregate": doc_id},
                session=session,
            )

    def _insert(
        self, ids: Sequence[str], collection: str, doc_id: Any, session: Any
    ) -> Steps[None]:
        if not ids:
            return
        expire_at = utc_now() + self.retention
        yield call(
            self.registry,
            "insert_many",
            [
                {"_id": i, "collection": collection, "aggregate": doc_id, "expire_at": expire_at}
                for i in ids
            ],
            ordered=False,
            session=session,
        )

    def _owned(
        self, ids: list[str], collection: str, doc_id: Any, session: Any, reserved: list[str]
    ) -> Steps[set[str]]:
        """Which of ``ids`` are already reserved for this document; DuplicateEventError (after
        releasing ``reserved``) if one is another document's."""
        found = yield listing(self.registry, "find", {"_id": {"$in": ids}}, session=session)
        mine: set[str] = set()
        for entry in found:
            if (entry.get("collection"), entry.get("aggregate")) == (collection, doc_id):
                mine.add(entry["_id"])
                continue
            yield from self.release(reserved, collection, doc_id, session)
            raise DuplicateEventError(
                f"event id {entry['_id']} is already in {entry.get('collection')} "
                f"{entry.get('aggregate')!r} (pending, or published less than retention ago): "
                "the broker would drop one of the two as a duplicate",
                collection=collection,
            )
        return mine


def _duplicate(error: BulkWriteError, collection: str) -> DuplicateEventError:
    return DuplicateEventError(
        f"an event id was reserved by another save meanwhile: {error}", collection=collection
    )
