"""The event-id registry of embedded mode: one event id, one aggregate document.

In collection mode the outbox collection's ``_id`` is the event id, so a reused id fails its
insert. In embedded mode the entries live in many documents and nothing stops two of them from
holding the same id; the broker would then drop the second as a duplicate of the first and the
relay mark both published, losing the second without a word. So each embedded save first
reserves its event ids here, ``{_id: event id, collection, aggregate: the document's _id,
expire_at}``, with one insert, and writes the document only once every id is its own.

A reservation is ``{_id: event id, collection, aggregate: the document's _id}``. It has no
``expire_at`` while its event is pending, however long that lasts (a relay down for longer than
``retention``, an entry parked for weeks): a pending id stays taken. The relay's settle marks it
``published`` with ``expire_at`` = now + ``retention`` before it removes the entry from its
document, so an id published a moment ago stays taken too, like a published entry of collection
mode, and the TTL index prunes it after ``retention``.

Why two writes lose nothing:

- A crash after the reservation and before the document write leaves a reservation and no event.
  A retry of that save (same collection, same document) finds its own reservation, not marked
  published, and goes on. (Without a retry the reservation stays: the id remains this
  document's, which costs one small registry document.)
- A crash of the relay after marking ids published and before removing their entries leaves the
  entries pending: they are published again (at least once) and marked again.
- A reservation of this document marked ``published`` is not a crash retry: the event went out
  and left the document, so saving the id again is refused like any reused id.
- A save that fails after reserving (a version conflict, a document too large) removes the
  reservations it made, so a refused save writes nothing.

A save inside a transaction reads the registry first and inserts only the missing ids: a
duplicate key would abort the caller's transaction, and the transaction makes the reservation and
the document write one.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from pymongo import UpdateOne
from pymongo.errors import BulkWriteError

from mongo_outbox._driver import DUPLICATE_KEY
from mongo_outbox._refusals import write_errors
from mongo_outbox._steps import Steps, call, listing
from mongo_outbox.errors import DuplicateEventError

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
        # No expire_at: a pending id stays taken until the relay marks it published.
        yield call(
            self.registry,
            "insert_many",
            [{"_id": i, "collection": collection, "aggregate": doc_id} for i in ids],
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
            here = (entry.get("collection"), entry.get("aggregate")) == (collection, doc_id)
            if here and not entry.get("published"):
                mine.add(entry["_id"])  # a retry of a save that crashed before its write
                continue
            yield from self.release(reserved, collection, doc_id, session)
            where = (
                "this document" if here else f"{entry.get('collection')} {entry.get('aggregate')!r}"
            )
            state = "published less than retention ago" if entry.get("published") else "pending"
            raise DuplicateEventError(
                f"event id {entry['_id']} is already taken by {where} ({state}): "
                "the broker would drop one of the two as a duplicate",
                collection=collection,
            )
        return mine


def _duplicate(error: BulkWriteError, collection: str) -> DuplicateEventError:
    return DuplicateEventError(
        f"an event id was reserved by another save meanwhile: {error}", collection=collection
    )


class PublishedIds:
    """The relay's side of the registry: ids whose events the broker confirmed."""

    def __init__(self, registry: Any, retention: timedelta) -> None:
        self.registry = registry
        self.retention = retention

    async def mark_published(
        self, published: Sequence[tuple[str, str, Any]], now: datetime
    ) -> None:
        """Mark each ``(event id, collection, document _id)`` published, to expire ``retention``
        from ``now``. An id with no reservation (one pruned under an older version's rule, or
        removed by hand) gets one, so it stays taken all the same."""
        if not published:
            return
        expire_at = now + self.retention
        marked = {"$set": {"published": True, "expire_at": expire_at}}
        ids = [event_id for event_id, _, _ in published]
        # One statement for the common case: every id has its reservation.
        found = await self.registry.update_many({"_id": {"$in": ids}}, marked)
        if found.matched_count >= len(set(ids)):
            return
        await self.registry.bulk_write(
            [
                UpdateOne(
                    {"_id": event_id},
                    {
                        "$set": {"published": True, "expire_at": expire_at},
                        "$setOnInsert": {"collection": collection, "aggregate": doc_id},
                    },
                    upsert=True,
                )
                for event_id, collection, doc_id in published
            ],
            ordered=False,
        )
