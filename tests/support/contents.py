"""What a database holds, read back whole: to check that a refused save wrote nothing."""

from __future__ import annotations

from typing import Any


async def contents(db: Any) -> dict[str, list[dict[str, Any]]]:
    """Every document of every collection of ``db``, by collection, in ``_id`` order. Empty
    collections are left out: a write that was taken back may leave one behind."""
    found: dict[str, list[dict[str, Any]]] = {}
    for name in sorted(await db.list_collection_names()):
        documents = await db[name].find().to_list(None)
        if documents:
            found[name] = sorted(documents, key=lambda document: repr(document["_id"]))
    return found
