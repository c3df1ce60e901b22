"""A relay group member's change stream asks the server for its own partition only: the
``$match`` on the partition number the writer stored, in both modes. (That members follow their
partitions end to end is tested in test_relay_group.py; this pins where the filtering happens.)"""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import AsyncMongoClient

from mongo_outbox import Outbox
from mongo_outbox.changestream import WatchSource


@pytest.fixture
def db() -> Any:
    return AsyncMongoClient("mongodb://127.0.0.1:9", connect=False).shop


def matches(source: WatchSource) -> dict[str, Any]:
    [stage] = source.pipeline
    match: dict[str, Any] = stage["$match"]
    return match


@pytest.mark.parametrize("mode", ["collection", "embedded"])
def test_a_partition_stream_matches_its_partition_and_a_whole_stream_none(
    db: Any, mode: str
) -> None:
    outbox = Outbox(db, mode=mode, collections=["orders"], partitions=4)  # type: ignore[arg-type]
    field = f"fullDocument.{outbox.partition_field}"
    [writes, *ends] = matches(WatchSource.for_outbox(outbox, partition=2))["$or"]
    assert writes[field] == 2
    assert all(field not in branch for branch in ends)  # drops and invalidations reach everyone
    assert field not in str(matches(WatchSource.for_outbox(outbox)))


def test_one_partition_needs_no_match_on_it(db: Any) -> None:
    match = matches(WatchSource.for_outbox(Outbox(db), partition=0))
    assert list(match) == ["operationType"]
    assert set(match["operationType"]["$in"]) == {
        "insert",
        "drop",
        "rename",
        "dropDatabase",
        "invalidate",
    }
