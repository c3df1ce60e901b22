"""What the unit tests share: collections of a client that never connects (``connect=False``,
and nothing here sends a command), so the write rules see real PyMongo collections, codec
options and write concerns without a server. Its address is a closed port: a rule that sent a
command after all would fail its test within 0.2 s (server selection), not pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient


@pytest.fixture(scope="module")
def offline() -> Iterator[MongoClient[Any]]:
    client: MongoClient[Any] = MongoClient(
        "mongodb://127.0.0.1:9", connect=False, serverSelectionTimeoutMS=200
    )
    yield client
    client.close()


@pytest.fixture
def shop(offline: MongoClient[Any]) -> Any:
    """The database ``shop`` of the offline client."""
    return offline.shop
