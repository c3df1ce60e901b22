"""The event-id registry of embedded mode: one event id, one aggregate document.

In collection mode the outbox collection's ``_id`` is the event id, so a reused id fails its
insert. In embedded mode the entries live in many documents and nothing stops two of them from
holding the same id; the broker would then drop the second as a duplicate of the first and the
relay mark both published, losing the second without a word. The registry holds
``{_id: event id, collection, aggregate: the document's _id}`` for every id pending or published
less than ``retention`` ago.

Who writes an id there:

- **A save, for an id that can collide**: one the caller chose (``Event(id=...)``), the id of an
  Event object given to a save before (a retry, or a reuse: ``Event._given``), and every id
  saved in a caller's transaction. It reserves the id with one insert before its document
  write, so a reused id is ``DuplicateEventError`` and nothing is written.
- **Nobody at save time, for an id the library made for a new Event object**: it is a fresh
  random id that no other event can hold, so the save is the document write alone (one round
  trip, like a hand-written ``update_one``). The object remembers the document a save outside a
  transaction put it in (``Event._home``, carried by copies and by the events the save returns):
  saving it to another document of the database is refused at once.
- **The relay, before it publishes**: it takes every id of a claimed document for that entry
  (``own``: one insert of all the claim's ids; only an id already there is checked, with an
  upsert keyed by the id, the document and the entry's sequence), so an id saved without a
  reservation gets one before its event can reach the broker. An id held otherwise (another
  document's, or this document's under another sequence: an id a caller copied, or a copy taken
  before its first save) is not published: its entry is parked with the reason, never dropped.

A registry entry has no ``expire_at`` while its event is pending, however long that lasts (a
relay down for longer than ``retention``, an entry parked for weeks): a pending id stays taken.
The relay's settle marks it ``published`` with ``expire_at`` = now + ``retention`` before it
removes the entry from its document, so an id published a moment ago stays taken too, like a
published entry of collection mode, and the TTL index prunes it after ``retention``.

Why the extra writes lose nothing:

- A crash after a reservation and before the document write leaves a reservation and no event.
  A retry of that save (same collection, same document) finds its own reservation, not marked
  published, and goes on. (Without a retry the reservation stays: the id remains this
  document's, which costs one small registry document.)
- A crash of the relay after taking ids and before publishing leaves them this document's: the
  next claim finds them its own. A crash after marking ids published and before removing their
  entries leaves the entries pending: they are published again (at least once) and marked again.
- A reservation of this document marked ``published`` is not a crash retry: the event went out
  and left the document, so saving the id again is refused like any reused id.
- A save that fails after reserving (a version conflict, a document too large) removes the
  reservations it made and forgets where its objects went, so a refused save writes nothing.

A save inside a transaction reserves every id (its objects keep no record: the caller may abort
the transaction), reading the registry first and inserting only the missing ids: a duplicate key
would abort the caller's transaction, and the transaction makes the reservation and the document
write one.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from pymongo import UpdateOne
from pymongo.errors import BulkWriteError

from mongo_outbox._commands import chunked
from mongo_outbox._driver import DUPLICATE_KEY
from mongo_outbox._steps import Steps, call, listing
from mongo_outbox._write.refusals import duplicate_id, write_errors
from mongo_outbox.errors import DuplicateEventError
from mongo_outbox.events import Event

_ATTEMPTS = 3  # a reservation that expires between our insert and our read is tried again


Home = tuple[str, Any]
"""Where an embedded save puts an event: its collection's full name, its document's ``_id``."""
Marks = list[tuple[Event, bool, Home | None]]
Holder = tuple[Any, Any]
"""An aggregate document as the registry and the relay name it: its collection's name, its
``_id``."""
Taken = tuple[Holder, Any]
"""Who holds an id in the registry: the document, and the entry's sequence."""


_marking = threading.Lock()


def mark(
    given: Sequence[Event], events: Sequence[Event], home: Home, in_transaction: bool
) -> tuple[list[str], Marks]:
    """``to_reserve`` and ``remember`` as one step, so that saves of one Event object from two
    threads (the sync API in a threaded server, or an event loop per thread) cannot both find
    it unsaved: the ids to reserve, and the marks ``forget`` restores."""
    with _marking:
        ids = to_reserve(given, home, in_transaction)
        return ids, remember([*given, *events], home, certain=not in_transaction)


def to_reserve(given: Sequence[Event], home: Home, in_transaction: bool) -> list[str]:
    """The ids of ``given`` a save to ``home`` must reserve; DuplicateEventError, before
    anything is written, for an object a save put in another document of the same database."""
    ids = []
    for event in given:
        marks = _marks(event)
        elsewhere = marks["_home"]
        # Another database has an outbox and a registry of its own: its reservation decides.
        if elsewhere is not None and elsewhere != home and _database(elsewhere) == _database(home):
            raise DuplicateEventError(
                f"event {event.id} was given to a save of {elsewhere[0]} {elsewhere[1]!r} (which "
                "may have written it): one event, one document (make a new Event for this one)",
                collection=home[0].split(".", 1)[1],
                event_id=event.id,
            )
        if in_transaction or marks["_given"] or "id" in event.model_fields_set:
            ids.append(event.id)
    return ids


def remember(events: Sequence[Event], home: Home, certain: bool) -> Marks:
    """Mark each object handed to a save, and with ``home`` when the save is ``certain`` (not in
    a transaction the caller may abort); return what they held, for ``forget``."""
    before: Marks = []
    seen: set[int] = set()
    for event in events:
        if id(event) in seen:
            continue
        seen.add(id(event))
        marks = _marks(event)
        before.append((event, marks["_given"], marks["_home"]))
        marks["_given"] = True
        if certain:
            marks["_home"] = home
    return before


def forget(before: Marks) -> None:
    """Undo ``remember`` after a save that wrote nothing."""
    with _marking:
        for event, given, home in before:
            marks = _marks(event)
            marks["_given"], marks["_home"] = given, home


def _marks(event: Event) -> dict[str, Any]:
    """The Event's private ``_given`` and ``_home``, where pydantic keeps them: read and set
    there, because pydantic's attribute path for private fields cost more than the rest of this
    bookkeeping together (benchmarks/bench_update.py)."""
    marks = event.__pydantic_private__
    assert marks is not None  # __init__, model_construct, copies and __setstate__ all set them
    return marks


def _database(home: Home) -> str:
    return home[0].split(".", 1)[0]


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
            f"event ids {wanted} kept colliding in {self.registry.name}",
            collection=collection,
            event_id=wanted[0],
        )

    def release(
        self, ids: Sequence[str], collection: str, doc_id: Any, session: Any
    ) -> Steps[None]:
        """Remove reservations ``reserve`` made, when the document write wrote nothing; not
        one a relay marked published meanwhile (a retry that raced the event out)."""
        if ids:
            yield call(
                self.registry,
                "delete_many",
                {
                    "_id": {"$in": list(ids)},
                    "collection": collection,
                    "aggregate": doc_id,
                    "published": {"$ne": True},
                },
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
                event_id=entry["_id"],
            )
        return mine


def _duplicate(error: BulkWriteError, collection: str) -> DuplicateEventError:
    taken = duplicate_id(error)
    return DuplicateEventError(
        f"event id {taken if taken is not None else '(one of these)'} was reserved by another "
        "save meanwhile: the broker would drop one of the two as a duplicate",
        collection=collection,
        event_id=taken,
    )


class PublishedIds:
    """The relay's side of the registry: ids whose events the broker confirmed."""

    def __init__(self, registry: Any, retention: timedelta) -> None:
        self.registry = registry
        self.retention = retention

    async def own(self, held: Mapping[str, Taken]) -> dict[str, Taken]:
        """Take each id of ``held`` (event id: its collection's name and document ``_id``, and
        its sequence) for that entry, unless it is that entry's already; return the ids held
        otherwise, each with the registry's holder and sequence: another document's, or this
        document's under another sequence (an event published before, its id given again)."""
        if not held:
            return {}
        # Most ids are new to the registry (the library made them and saves do not reserve
        # them): one insert of the whole claim. Only the ids already there need a condition.
        ids = list(held)
        entries = [
            {"_id": i, "collection": collection, "aggregate": doc_id, "sequence": sequence}
            for i, ((collection, doc_id), sequence) in held.items()
        ]
        try:
            await self.registry.insert_many(entries, ordered=False)
            return {}
        except BulkWriteError as error:
            there = {ids[e["index"]]: e.get("code") for e in write_errors(error)}
            if not there or any(code != DUPLICATE_KEY for code in there.values()):
                raise  # not (only) ids already there: a write concern error, say
        return await self._take({i: held[i] for i in there})

    async def _take(self, held: Mapping[str, Taken]) -> dict[str, Taken]:
        ids = list(held)
        ops = []
        for i in ids:
            (collection, doc_id), sequence = held[i]
            # A save's reservation has no sequence yet; a crashed relay's own has this one.
            mine = {
                "_id": i,
                "collection": collection,
                "aggregate": doc_id,
                "sequence": {"$in": [sequence, None]},
            }
            ops.append(UpdateOne(mine, {"$set": {"sequence": sequence}}, upsert=True))
        try:
            await self.registry.bulk_write(ops, ordered=False)
            return {}
        except BulkWriteError as error:
            failed = {ids[e["index"]]: e.get("code") for e in write_errors(error)}
            if any(code != DUPLICATE_KEY for code in failed.values()):
                raise
        # The filter missed and the insert collided: the id is held otherwise.
        found = []
        for chunk in chunked(list(failed)):
            found += await self.registry.find({"_id": {"$in": chunk}}).to_list(None)
        return {
            d["_id"]: ((d.get("collection"), d.get("aggregate")), d.get("sequence")) for d in found
        }

    async def mark_published(
        self, published: Sequence[tuple[str, str, Any]], now: datetime, by: str | None = None
    ) -> None:
        """Mark each ``(event id, collection, document _id)`` published, to expire ``retention``
        from ``now``. An id with no reservation (one pruned under an older version's rule, or
        removed by hand) gets one, so it stays taken all the same."""
        if not published:
            return
        expire_at = now + self.retention
        # Who published them (``by``, a relay's name), for the console's rates.
        marked = {"$set": {"published": True, "expire_at": expire_at, "published_by": by}}
        ids = list(dict.fromkeys(event_id for event_id, _, _ in published))
        # One statement for the common case (a claim's worth of ids, in bounded commands):
        # every id has its reservation.
        matched = 0
        for chunk in chunked(ids):
            matched += (
                await self.registry.update_many({"_id": {"$in": chunk}}, marked)
            ).matched_count
        if matched >= len(ids):
            return
        await self.registry.bulk_write(
            [
                UpdateOne(
                    {"_id": event_id},
                    {
                        "$set": {"published": True, "expire_at": expire_at, "published_by": by},
                        "$setOnInsert": {"collection": collection, "aggregate": doc_id},
                    },
                    upsert=True,
                )
                for event_id, collection, doc_id in published
            ],
            ordered=False,
        )
