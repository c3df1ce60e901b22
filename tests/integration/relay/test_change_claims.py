"""A change-stream relay's claim in collection mode (``CollectionStore.claim_changes``): entries
a batch of inserts holds whole (each aggregate's from sequence 1 on) and still fresh are claimed
as the stream gave them, without reading their aggregates again; anything else (an aggregate
the batch holds from its middle, an entry tried since it was inserted, entries read as the relay
does not read them) is claimed and read as a sweep's are, so it waits behind what holds its
aggregate back and keeps the counters stored since."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from bson.codec_options import CodecOptions, DatetimeConversion
from pymongo import AsyncMongoClient, monitoring

from mongo_outbox import Event
from mongo_outbox._relay.store.base import Claim
from mongo_outbox._relay.store.collection import CollectionStore
from mongo_outbox.admin import OutboxAdmin
from mongo_outbox.events import utc_now
from tests.support.outboxes import make_outbox
from tests.support.servers import MongoServer

LEASE = timedelta(seconds=30)


class Commands(monitoring.CommandListener):
    def __init__(self) -> None:
        self.names: list[str] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.names.append(event.command_name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


async def saved(db: Any, aggregates: dict[str, int]) -> dict[str, list[Event]]:
    outbox = make_outbox(db)
    await outbox.ensure_indexes()
    return {
        name: (
            await outbox.save_with_events(
                None, db.orders, {"_id": name}, [Event(type="e") for _ in range(count)]
            )
        ).events
        for name, count in aggregates.items()
    }


async def inserts(collection: Any, ids: list[str]) -> list[dict[str, Any]]:
    """The insert changes of these entries, as a change stream gives them: the entry as it
    was inserted (read before anything else changes it)."""
    docs = {d["_id"]: d for d in await collection.find({"_id": {"$in": ids}}).to_list(None)}
    return [{"operationType": "insert", "fullDocument": docs[i]} for i in ids]


async def claimed_watched(
    mongo: MongoServer, db: Any, *batches: list[dict[str, Any]]
) -> list[tuple[Claim, list[str]]]:
    """The claims of ``batches`` by one store, each with the commands it sent."""
    listener = Commands()
    watched: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, tz_aware=True, event_listeners=[listener]
    )
    store = CollectionStore(make_outbox(watched[db.name]))
    claims = []
    try:
        for changes in batches:
            listener.names.clear()
            claim = await store.claim_changes(changes, LEASE)
            claims.append((claim, list(listener.names)))
        return claims
    finally:
        await watched.close()


def ids_of(events: list[Event]) -> list[str]:
    return [e.id for e in events]


async def test_inserts_holding_their_aggregates_whole_are_claimed_without_a_read(
    db: Any, mongo: MongoServer
) -> None:
    events = await saved(db, {"a": 3, "b": 1, "c": 2})
    later = await saved(db, {"d": 2})
    changes = await inserts(db.outbox, [e.id for group in events.values() for e in group])
    more = await inserts(db.outbox, ids_of(later["d"]))
    (claim, sent), (second, then) = await claimed_watched(mongo, db, changes, more)
    assert sorted(ids_of(list(g)) for g in claim.groups) == sorted(
        ids_of(g) for g in events.values()
    )
    # The claim alone, no read of the aggregates (the store asks for the unique index once).
    assert sent == ["listIndexes", "update"] and then == ["update"]
    assert [ids_of(list(g)) for g in second.groups] == [ids_of(later["d"])]
    assert not claim.more and set(claim.attempts.values()) == {0}
    assert await db.outbox.count_documents({"claim": claim.token}) == 6


async def test_without_the_unique_index_of_sequences_every_aggregate_is_read(
    db: Any, mongo: MongoServer
) -> None:
    # An aggregate's sequence 1 may then be stored twice: no batch holds it whole.
    events = await saved(db, {"a": 2})
    await db.outbox.drop_index("aggregate_sequence")
    changes = await inserts(db.outbox, ids_of(events["a"]))
    [(claim, sent)] = await claimed_watched(mongo, db, changes)
    assert [ids_of(list(g)) for g in claim.groups] == [ids_of(events["a"])]
    assert "find" in sent


async def test_a_requeued_entry_replayed_from_its_insert_is_sent_as_stored_now(
    db: Any, mongo: MongoServer
) -> None:
    # Parked, mended by hand and requeued: it looks fresh again, but its insert's image is
    # no longer what it holds (a stream replayed after a restart gives the old one).
    events = await saved(db, {"a": 1})
    [event] = events["a"]
    changes = await inserts(db.outbox, [event.id])
    parked = {"status": "parked", "attempts": 3, "last_error": "refused"}
    await db.outbox.update_one({"_id": event.id}, {"$set": parked})
    await db.outbox.update_one({"_id": event.id}, {"$set": {"payload": {"mended": True}}})
    await OutboxAdmin(make_outbox(db)).requeue([event.id])
    [(claim, sent)] = await claimed_watched(mongo, db, changes)
    [[claimed]] = claim.groups
    assert claimed.id == event.id and claimed.payload == {"mended": True}
    assert "find" in sent


async def test_another_producer_s_aggregate_id_of_another_type_makes_no_aggregate_whole(
    db: Any, mongo: MongoServer
) -> None:
    # Python takes True for 1 (MongoDB does not): another producer's (orders, True) sequence 1
    # must not pass for the first entry of (orders, 1), whose own first entry backs off.
    outbox = make_outbox(db)
    await outbox.ensure_indexes()
    first, second = (
        await outbox.save_with_events(
            None, db.orders, {"_id": 1}, [Event(type="e"), Event(type="e")]
        )
    ).events
    backoff = {"attempts": 1, "available_at": utc_now() + timedelta(minutes=1)}
    await db.outbox.update_one({"_id": first.id}, {"$set": backoff})
    other = {"_id": "other", "type": "e", "payload": {}, "status": "pending", "attempts": 0}
    other |= {"aggregate_type": "orders", "aggregate_id": True, "sequence": 1}
    await db.outbox.insert_one(other | {"occurred_at": utc_now(), "available_at": utc_now()})
    changes = await inserts(db.outbox, [second.id, "other"])
    [(claim, sent)] = await claimed_watched(mongo, db, changes)
    assert second.id not in [e.id for g in claim.groups for e in g]  # it waits behind first
    assert "find" in sent


async def test_an_aggregate_a_batch_holds_from_its_middle_is_read_and_waits_behind_it(
    db: Any, mongo: MongoServer
) -> None:
    events = await saved(db, {"a": 3, "b": 2})
    first = events["a"][0]
    changes = await inserts(db.outbox, ids_of(events["a"][1:] + events["b"]))
    # The first of a is another relay's: what follows it in the batch must wait.
    leased = {"claim": "another relay's", "available_at": utc_now() + timedelta(minutes=1)}
    await db.outbox.update_one({"_id": first.id}, {"$set": leased})
    listener = Commands()
    watched: AsyncMongoClient[Any] = AsyncMongoClient(
        mongo.uri, tz_aware=True, event_listeners=[listener]
    )
    try:
        claim = await CollectionStore(make_outbox(watched[db.name])).claim_changes(changes, LEASE)
        sent = list(listener.names)
    finally:
        await watched.close()
    assert [ids_of(list(g)) for g in claim.groups] == [ids_of(events["b"])]
    assert claim.more  # a's two wait for a sweep
    assert sent.count("find") == 1  # a alone was read
    assert await db.outbox.count_documents({"claim": claim.token}) == 2


async def test_an_entry_tried_since_it_was_inserted_keeps_its_counters(db: Any) -> None:
    events = await saved(db, {"a": 2})
    changes = await inserts(db.outbox, ids_of(events["a"]))  # as inserted: attempts 0
    tried = {"attempts": 2, "last_error": "broker down", "available_at": utc_now()}
    await db.outbox.update_one({"_id": events["a"][0].id}, {"$set": tried})
    claim = await CollectionStore(make_outbox(db)).claim_changes(changes, LEASE)
    assert [ids_of(list(g)) for g in claim.groups] == [ids_of(events["a"])]
    # Counted from what is stored now, not from the stream's image of the insert.
    assert claim.attempts[events["a"][0].id] == 2


async def test_two_relays_claiming_one_batch_at_once_share_it_without_overlap(db: Any) -> None:
    events = await saved(db, {f"o{n}": 1 + n % 3 for n in range(30)})
    every = [e.id for group in events.values() for e in group]
    changes = await inserts(db.outbox, every)
    outbox = make_outbox(db)
    claims = await asyncio.gather(
        CollectionStore(outbox).claim_changes(changes, LEASE),
        CollectionStore(outbox).claim_changes(changes, LEASE),
    )
    got = [[e.id for g in claim.groups for e in g] for claim in claims]
    assert not set(got[0]) & set(got[1])
    assert sorted(got[0] + got[1]) == sorted(every)
    for claim in claims:
        for group in claim.groups:
            sequences = [e.sequence for e in group]
            assert sequences == sorted(sequences)


async def test_entries_read_as_the_relay_does_not_read_them_are_read_again(
    db: Any, mongo: MongoServer
) -> None:
    # A client of DATETIME_MS dates (or any codec the relay's own reads do not use) gives the
    # stream's documents in its types: the entries are read again with the relay's own.
    events = await saved(db, {"a": 2})
    options = CodecOptions(datetime_conversion=DatetimeConversion.DATETIME_MS)
    changes = await inserts(db.outbox.with_options(codec_options=options), ids_of(events["a"]))
    assert not isinstance(changes[0]["fullDocument"]["occurred_at"], type(utc_now()))
    claim = await CollectionStore(make_outbox(db)).claim_changes(changes, LEASE)
    assert [ids_of(list(g)) for g in claim.groups] == [ids_of(events["a"])]
    assert [g[0].occurred_at for g in claim.groups] == [events["a"][0].occurred_at]
