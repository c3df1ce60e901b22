"""Filters on ``_id`` (equality and ``$in``, as the relay's claim and settle send them) find what
MongoDB finds: the emulator answers them through the ``_id`` keys instead of a scan
(``mongo_outbox.testing._numeric_ids``), and a replica set through its ``_id`` index."""

from __future__ import annotations

from typing import Any

from bson import Int64, ObjectId
from pymongo import AsyncMongoClient

OID = ObjectId("000000000000000000000007")


async def test_in_on_ids_finds_equal_values_of_every_kind_and_skips_missing_ones(db: Any) -> None:
    await db.c.insert_many(
        [{"_id": "a", "n": 1}, {"_id": "b", "n": 2}, {"_id": OID, "n": 3}, {"_id": 1, "n": 4}]
    )
    await db.c.insert_one({"_id": 2.5, "n": 5})
    found = await db.c.find({"_id": {"$in": ["b", "missing", OID, 1.0, Int64(9), "a"]}}).to_list()
    assert sorted(doc["n"] for doc in found) == [1, 2, 3, 4]
    assert await db.c.find_one({"_id": Int64(1)}) == {"_id": 1, "n": 4}
    assert await db.c.find_one({"_id": "missing"}) is None
    # The rest of the filter still applies to the documents the ids name.
    assert [d["_id"] async for d in db.c.find({"_id": {"$in": ["a", "b"]}, "n": {"$gt": 1}})] == [
        "b"
    ]


async def test_update_many_by_ids_writes_only_the_named_documents_that_match(db: Any) -> None:
    await db.c.insert_many([{"_id": f"e{n}", "status": "pending"} for n in range(50)])
    await db.c.update_one({"_id": "e3"}, {"$set": {"status": "published"}})
    result = await db.c.update_many(
        {"_id": {"$in": ["e1", "e3", "e5", "e99"]}, "status": "pending"},
        {"$set": {"claim": "t"}},
    )
    assert (result.matched_count, result.modified_count) == (2, 2)
    assert sorted(d["_id"] for d in await db.c.find({"claim": "t"}).to_list()) == ["e1", "e5"]
    # An upsert of an _id not stored inserts it, once.
    for _ in range(2):
        await db.c.update_one({"_id": "new"}, {"$inc": {"n": 1}}, upsert=True)
    assert await db.c.find_one({"_id": "new"}) == {"_id": "new", "n": 2}


async def test_numbers_inside_an_id_still_match_equal_numbers_by_in(db: Any) -> None:
    # A number inside a document is compared by a scan: it and a plain numeric _id both match.
    await db.c.insert_many([{"_id": {"k": 1}}, {"_id": 2}])
    assert await db.c.count_documents({"_id": {"$in": [{"k": 1.0}, 2.0]}}) == 2
    assert await db.c.count_documents({"_id": {"$in": [Int64(2)]}}) == 1


async def test_a_transaction_finds_its_own_and_committed_documents_by_ids_but_no_one_elses(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.c.insert_one({"_id": "committed"})
    await db.create_collection("d")
    async with client.start_session() as mine, client.start_session() as theirs:
        await mine.start_transaction()
        await theirs.start_transaction()
        await db.c.insert_one({"_id": "mine"}, session=mine)
        await db.c.insert_one({"_id": "theirs"}, session=theirs)
        ids = {"_id": {"$in": ["committed", "mine", "theirs"]}}
        assert sorted(d["_id"] for d in await db.c.find(ids, session=mine).to_list()) == [
            "committed",
            "mine",
        ]
        await mine.commit_transaction()
        await theirs.abort_transaction()
    assert sorted(d["_id"] for d in await db.c.find(ids).to_list()) == ["committed", "mine"]
