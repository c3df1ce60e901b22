"""Partitions of an outbox: which of ``P`` partitions an aggregate's entries belong to, and the
config document that records ``P`` so every writer and relay agrees on it.

The partition is a CRC32 of the aggregate's identity (its ``aggregate_type`` and
``aggregate_id``, encoded as BSON) modulo ``P``: the same in every process and on every Python
version (``hash()`` is salted per process), and computed once by the writer, which stores it
with the entries; a relay only filters on the stored number. Every entry of an aggregate lands
in one partition, so a partition's relay sees an aggregate's whole history, in order.

Where it is stored: collection mode, ``partition`` on each outbox entry; embedded mode,
``<field>_partition`` on the aggregate document (a claim takes the whole document). With
``P = 1`` nothing is stored and nothing filtered, so an outbox written before partitions existed
reads as one partition.

The config document ``{_id: "partitions", count: P}`` lives in ``<collection>_config``. The
first writer or relay with ``P > 1`` records it; each outbox object checks it once (one read)
before its first write, each relay group before it starts: a different ``P`` raises
``ConfigurationError``. Changing ``P`` needs every pending entry published first (their stored
numbers would be of the old ``P``): see docs/groups.md.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

import bson
from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from mongo_outbox._steps import Steps, call
from mongo_outbox.errors import ConfigurationError

log = logging.getLogger("mongo_outbox")

CONFIG_ID = "partitions"


def partition_of(aggregate_type: Any, aggregate_id: Any, count: int) -> int:
    """The partition (``0 <= p < count``) of an aggregate's entries."""
    if count == 1:
        return 0
    canonical = bson.encode({"t": aggregate_type, "i": aggregate_id})
    return zlib.crc32(canonical) % count


def config_collection(outbox_db: Any, collection: str) -> Any:
    return outbox_db[f"{collection}_config"]


def check_config(config: Any, count: int, who: str) -> Steps[None]:
    """Record ``count`` as the outbox's partition count if none is recorded (only when it is
    above 1: an unpartitioned outbox needs no record), else refuse a different one."""
    if count == 1:
        found = yield call(config, "find_one", {"_id": CONFIG_ID})
    else:
        try:
            found = yield call(
                config,
                "find_one_and_update",
                {"_id": CONFIG_ID},
                {"$setOnInsert": {"count": count}},
                upsert=True,
                return_document=ReturnDocument.BEFORE,
            )
        except DuplicateKeyError:
            # Two first writers raced to record it: the other's record is there now.
            found = yield call(config, "find_one", {"_id": CONFIG_ID})
        else:
            if found is None:
                # Said aloud: from now on a writer or relay with another count is refused (a
                # trial run with the wrong count would stop every writer at its next start).
                log.warning(
                    "%s recorded partitions=%d in %s: every writer and relay of this outbox "
                    "must now use partitions=%d (docs/groups.md says how to change it)",
                    who,
                    count,
                    config.name,
                    count,
                )
                found = {"count": count}
    recorded = 1 if found is None else found.get("count")
    if recorded != count:
        raise ConfigurationError(
            f"{who} has partitions={count}, but the outbox's {config.name} records "
            f"partitions={recorded}: every writer and relay of an outbox must use the recorded "
            "count (to change it: stop writers and relays, drain, update the record, restart; "
            "see docs/groups.md)",
            setting="partitions",
        )
