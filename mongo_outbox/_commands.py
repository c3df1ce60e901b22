"""Commands of bounded size: a list of values one command names (ids in an ``$in``, selectors
in an ``$or``) goes out in slices. MongoDB refuses a command over 16 MiB, and PyMongo raises
``DocumentTooLarge`` before sending it, which is no ``PyMongoError``: a relay with a large
``batch_size`` (70k claimed entries of long ids) ended for good at its first claim."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import bson

IDS_PER_COMMAND = 1000
"""How many values one command names at most."""
BYTES_PER_COMMAND = 4 * 1024 * 1024
"""About how many bytes of values one command holds at most: well under 16 MiB, whatever else
the command carries, also with ids much longer than usual."""

T = TypeVar("T")


def chunked(values: Sequence[T]) -> list[list[T]]:
    """``values`` in order, in slices of at most ``IDS_PER_COMMAND`` values and about
    ``BYTES_PER_COMMAND`` bytes (a single larger value makes a slice of its own)."""
    chunks: list[list[T]] = []
    chunk: list[T] = []
    size = 0
    for value in values:
        grown = size + _size(value)
        if chunk and (len(chunk) >= IDS_PER_COMMAND or grown > BYTES_PER_COMMAND):
            chunks.append(chunk)
            chunk, grown = [], _size(value)
        chunk.append(value)
        size = grown
    if chunk:
        chunks.append(chunk)
    return chunks


def _size(value: Any) -> int:
    if isinstance(value, str):
        return len(value) * 4 + 8  # UTF-8 takes at most four bytes a character
    try:
        return len(bson.encode({"": value}))
    except (bson.errors.BSONError, TypeError, ValueError):
        return 64  # not BSON as it is (a UUID without a representation): the driver decides
