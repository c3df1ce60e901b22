"""What a failed command does to its transaction, and what a transaction may create.

MongoDB aborts a transaction whose command failed: after a duplicate key inside it, its next
command gets ``NoSuchTransaction`` (251) and nothing it wrote is committed. A command a server
does not run in a transaction (``count``) is refused with ``OperationNotSupportedInTransaction``
(263). ``createIndexes`` on a new collection inside a transaction creates both at commit. The
transactions specification tests (tests/conformance) check the same; these run without them.
"""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import DuplicateKeyError, OperationFailure

NO_SUCH_TRANSACTION = 251
OPERATION_NOT_SUPPORTED_IN_TRANSACTION = 263


def _insert(db: Any, session: Any) -> Any:
    return db.c.insert_one({"_id": 1}, session=session)


def _upsert(db: Any, session: Any) -> Any:
    # Matches nothing (the stored _id 1 has no x), so its insert hits the _id 1: a command
    # that raises in the emulator where insert replies with a write error.
    return db.c.find_one_and_update(
        {"_id": 1, "x": 1}, {"$set": {"y": 1}}, upsert=True, session=session
    )


@pytest.mark.parametrize("duplicate", [_insert, _upsert], ids=["insert", "findAndModify upsert"])
async def test_a_duplicate_key_inside_a_transaction_aborts_it(
    client: AsyncMongoClient[Any], db: Any, duplicate: Any
) -> None:
    await db.c.insert_one({"_id": 1})
    async with client.start_session() as session:
        await session.start_transaction()
        await db.c.insert_one({"_id": 2}, session=session)
        with pytest.raises(DuplicateKeyError):
            await duplicate(db, session)
        with pytest.raises(OperationFailure) as refused:
            await db.c.insert_one({"_id": 3}, session=session)
        assert refused.value.code == NO_SUCH_TRANSACTION
        assert refused.value.has_error_label("TransientTransactionError")
        with pytest.raises(OperationFailure) as commit:
            await session.commit_transaction()
        assert commit.value.code == NO_SUCH_TRANSACTION
    assert await db.c.find().to_list() == [{"_id": 1}]


async def test_count_is_refused_inside_a_transaction(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    await db.c.insert_one({"_id": 1})
    async with client.start_session() as session:
        await session.start_transaction()
        await db.c.insert_one({"_id": 2}, session=session)
        with pytest.raises(OperationFailure) as refused:
            await db.command("count", "c", session=session)
        assert refused.value.code == OPERATION_NOT_SUPPORTED_IN_TRANSACTION
        assert not refused.value.has_error_label("TransientTransactionError")
        await session.abort_transaction()
    assert await db.c.find().to_list() == [{"_id": 1}]


async def test_an_index_created_in_a_transaction_on_a_new_collection_exists_after_commit(
    client: AsyncMongoClient[Any], db: Any
) -> None:
    async with client.start_session() as session:
        await session.start_transaction()
        await db.fresh.create_index("x", name="x_1", session=session)
        assert "fresh" not in await db.list_collection_names()
        await session.commit_transaction()
    assert "fresh" in await db.list_collection_names()
    assert "x_1" in [index["name"] async for index in await db.fresh.list_indexes()]
